"""`vcuda-agent run` with authenticated metrics over HTTPS, as a process: the token is
checked against the emulated API server through the agent's own API client, the port speaks
only TLS, the probes stay open; an unusable certificate stops the start with a clear line
(exit 1, nothing left behind); asking for authentication without an API server is refused."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster
from tests.integration.test_agent_process import run_agent
from tests.selfsigned import make_certificate


def get(url: str, context: ssl.SSLContext, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_agent_serves_authenticated_metrics_over_https(
    start_agent: Callable[..., AgentProcess], cluster: Cluster, short_dir: Path
) -> None:
    cert, key = make_certificate(short_dir)
    reader = {"metadata": {"name": "reader"}, "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}
    cluster.api.create_object("clusterroles", reader)
    binding = {
        "metadata": {"name": "alice-reads"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "reader"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}],
    }
    cluster.api.create_object("clusterrolebindings", binding)
    tls = ("--metrics-tls-cert", str(cert), "--metrics-tls-key", str(key))
    agent = start_agent("1xT4-16GB", "--metrics-auth", "kubernetes", *tls, kube=cluster.kube)
    match = agent.wait_for_log(r"metrics on https://[^:]+:(\d+)/metrics \(bearer token", timeout_s=30)
    base = f"https://127.0.0.1:{match.group(1)}"
    verified = ssl.create_default_context(cafile=str(cert))
    assert get(f"{base}/metrics", verified)[0] == 401
    assert get(f"{base}/metrics", verified, cluster.api.auth.add_token("t-bob", "bob"))[0] == 403
    code, text = get(f"{base}/metrics", verified, cluster.api.auth.add_token("t-alice", "alice"))
    assert code == 200 and "vcuda_gpu_healthy" in text
    assert get(f"{base}/healthz", verified) == (200, "ok\n")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/healthz", timeout=10)
    assert agent.proc.poll() is None
    assert "open to anyone" not in agent.log()


def test_an_unusable_certificate_stops_the_start_clearly(short_dir: Path) -> None:
    missing = short_dir / "missing.pem"
    result = run_agent(short_dir, "--metrics-tls-cert", str(missing), "--metrics-tls-key", str(missing))
    assert result.returncode == 1
    assert f"--metrics-tls-cert/--metrics-tls-key: cannot use {missing}" in result.stderr
    assert not (short_dir / "dp" / "vcuda-core.sock").exists()
    assert not (short_dir / "sim" / "node.json").exists()


def test_authentication_without_an_api_server_is_refused(short_dir: Path) -> None:
    result = run_agent(short_dir, "--metrics-auth", "kubernetes")
    assert result.returncode == 2
    assert "--metrics-auth kubernetes asks the Kubernetes API" in result.stderr
    assert "open to anyone" not in result.stderr
