"""A real Prometheus for tests: Debian's package (installed on demand, its service never
started), run on loopback with a generated configuration and a throw-away TSDB, queried
through its HTTP API."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BINARY = Path("/usr/bin/prometheus")
POLICY_RC = Path("/usr/sbin/policy-rc.d")
JOB = "vcuda-agent"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_installed() -> Path:
    """/usr/bin/prometheus, installed from the distribution if missing (deploy/host/setup.sh
    normally does it up front). Skips, with the reason, where it cannot be installed."""
    if BINARY.exists():
        return BINARY
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{BINARY} is missing and cannot be installed here (needs root and apt-get)")
    # The package's maintainer scripts would start (and enable) a Prometheus service on :9090;
    # a policy-rc.d answering 101 forbids that, for both invoke-rc.d and deb-systemd-invoke.
    own_policy = not POLICY_RC.exists()
    if own_policy:
        POLICY_RC.write_text(
            "#!/bin/sh\n# vcuda-agent tests: installing prometheus, start no service\nexit 101\n"
        )
        POLICY_RC.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another apt-get (a parallel test, setup.sh) may hold the dpkg lock: wait for it.
    install = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=120"]
    install += ["--no-install-recommends", "prometheus"]
    try:
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:  # a stale package index: refresh once
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    finally:
        if own_policy:
            POLICY_RC.unlink()
    if done.returncode != 0 or not BINARY.exists():
        pytest.fail(
            f"apt-get install prometheus failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr}"
        )
    return BINARY


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    def get(self, path: str, params: dict[str, str] | list[tuple[str, str]]) -> Any:
        """The ``data`` of an API answer; raises AssertionError with Prometheus's error."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as err:  # 400/422: a PromQL error, explained in the body
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at now; a vector's or scalar's samples as [{metric, value}]."""
        data = self.get("/api/v1/query", {"query": expr})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` asks Prometheus."""
        return list(self.get(f"/api/v1/label/{label}/values", [("match[]", match)]))

    def targets(self) -> dict[str, dict[str, Any]]:
        """The active targets by job name (health, lastError...)."""
        data = self.get("/api/v1/targets", {"state": "active"})
        return {t["labels"]["job"]: t for t in data["activeTargets"]}

    def targets_up(self) -> bool:
        data = self.get("/api/v1/targets", {"state": "active"})
        return any(t["health"] == "up" for t in data["activeTargets"])


def write_config(path: Path, target: str, jobs: dict[str, dict[str, Any]] | None = None) -> None:
    """JSON is YAML: no YAML writer needed. 1 s scrapes so a test sees data within seconds.
    ``jobs``: job name -> extra scrape settings (authorization, scheme...), each scraping
    ``target``; by default one plain job JOB."""
    jobs = {JOB: {}} if jobs is None else jobs
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": name, "static_configs": [{"targets": [target]}], **extra}
            for name, extra in jobs.items()
        ],
    }
    path.write_text(json.dumps(config, indent=2))


@contextlib.contextmanager
def running_prometheus(
    workdir: Path, target: str, *, startup_s: float = 30, jobs: dict[str, dict[str, Any]] | None = None
) -> Iterator[Prometheus]:
    """Prometheus scraping ``target`` (host:port; ``jobs`` as write_config takes them);
    stopped and its TSDB removed on exit."""
    binary = ensure_installed()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.json"
    write_config(config, target, jobs)
    port = free_port()
    log = workdir / "prometheus.log"
    cmd = [
        str(binary),
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + startup_s
        while not _ready(server.url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir / "tsdb", ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as answer:
            return int(answer.status) == 200
    except OSError:  # refused while it starts; URLError is an OSError
        return False
