"""A real Prometheus scrapes an agent run with the DaemonSet's --metrics-auth through the
emulated API server's TokenReview and SubjectAccessReview: with the token of the monitoring
overlay's scraper account (what the ServiceMonitor's ``authorization`` hands it) the pods'
series arrive; without a token, or with a tenant pod's token, the target is down with 401 /
403 and none of its series are stored; one review per token serves many scrapes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import AgentProcess
from tests.integration.deploy_render import daemonset_metrics_args, one, render
from tests.integration.kubecluster import Cluster, pod_manifest
from tests.integration.prometheus import Prometheus, running_prometheus

pytestmark = pytest.mark.slow
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"


def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.5)


def test_prometheus_scrapes_through_token_and_rbac(
    start_agent: Callable[..., AgentProcess], cluster: Cluster, short_dir: Path
) -> None:
    docs = render("deploy/overlays/monitoring")
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            cluster.api.create_object(doc["kind"].lower() + "s", doc)
    [endpoint] = one(docs, "ServiceMonitor", "vcuda-agent")["spec"]["endpoints"]
    secret = one(docs, "Secret", endpoint["authorization"]["credentials"]["name"])
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    # What the token controller puts in the Secret, and the Operator hands Prometheus.
    token_file = short_dir / "scraper-token"
    token_file.write_text(cluster.api.auth.service_account_token(secret["metadata"]["namespace"], account))
    tenant_file = short_dir / "tenant-token"
    tenant_file.write_text(cluster.api.auth.service_account_token("default", "default"))

    agent = start_agent("2xH100-80GB", *daemonset_metrics_args(), kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    cluster.node.run_pod(pod_manifest("trainer", ("cuda", 30, 1024)))
    port = agent.metrics_port()

    def bearer(path: Path) -> dict[str, object]:
        return {"authorization": {"type": "Bearer", "credentials_file": str(path)}}

    jobs = {
        "scraper": {"metrics_path": endpoint["path"], "honor_labels": True, **bearer(token_file)},
        "anonymous": {},
        "tenant": bearer(tenant_file),
    }
    with running_prometheus(short_dir / "prometheus", f"127.0.0.1:{port}", jobs=jobs) as prometheus:
        started = time.monotonic()
        until(lambda: _scrapes(prometheus, "scraper") >= 5, 60, "five scrapes with the token")
        targets = prometheus.targets()
        assert targets["scraper"]["health"] == "up", targets["scraper"]
        assert targets["anonymous"]["health"] == "down" and "401" in targets["anonymous"]["lastError"]
        assert targets["tenant"]["health"] == "down" and "403" in targets["tenant"]["lastError"]
        pods = prometheus.query('count by (job) ({pod="trainer"})')
        assert [s["metric"]["job"] for s in pods] == ["scraper"], "only the scraper's job stores the pod"
        elapsed = time.monotonic() - started
        reviews = sum(1 for r in cluster.api.request_log if r.path == TOKEN_REVIEWS)
        # Two tokens, each reviewed once per 30 s cache period, however often they scrape.
        assert reviews <= 2 * (1 + int(elapsed // 30)), reviews
    assert agent.proc.poll() is None


def _scrapes(prometheus: Prometheus, job: str) -> float:
    result = prometheus.query(f'sum_over_time(up{{job="{job}"}}[1m])')
    return float(result[0]["value"][1]) if result else 0.0
