"""Shared fixtures: short temp dirs for unix sockets, a real agent process, the kubelet emulator.

With VCUDA_REQUIRE_PRIVILEGED=1 (CI runs as root with BPF), a skipped test marked
``privileged`` fails the run instead of hiding a missing capability.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import sim_agent_command

REQUIRE_PRIVILEGED = os.environ.get("VCUDA_REQUIRE_PRIVILEGED") == "1"
# Files that measure caps against real time with a few pp of tolerance: under `make test`'s
# two workers they run one after another (two at once on two cores was seen to cost them
# their accuracy), beside the rest.
MEASURING_CAPS = frozenset(
    {
        "test_enforcement.py",
        "test_dra_enforcement.py",
        "test_mps_enforcement.py",
        "test_mps_v3.py",
        "test_demo_live.py",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For ``--dist loadgroup``: each file is one group (as ``loadfile``), except the files
    that measure caps, which share one, and the real-runtime tier, whose containerds share
    the host's kubepods cgroups (and whose session clean-up removes them): one worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            if item.path.name in MEASURING_CAPS:
                group = "measuring-caps"
            elif item.path.parent.name == "runtime":
                group = "runtime"
            else:
                group = str(item.path)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # An expected failure (xfail) ran and failed the way its reason says: not a hidden skip.
    skipped = report.skipped and not hasattr(report, "wasxfail")
    if REQUIRE_PRIVILEGED and skipped and item.get_closest_marker("privileged"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"privileged test skipped while VCUDA_REQUIRE_PRIVILEGED=1: {reason}"
    return report


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="vc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class AgentProcess:
    """``vcuda-agent run --simulate ...`` as a real child process."""

    proc: subprocess.Popen[bytes]
    plugin_dir: Path
    sim_dir: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout_s: float = 10.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in the agent log within {timeout_s} s:\n{self.log()}")

    def metrics_port(self) -> int:
        return int(self.wait_for_log(r"metrics on http://[^:]+:(\d+)/metrics").group(1))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=timeout_s)


@pytest.fixture
def start_agent(short_dir: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(spec: str = "2xH100-80GB", *extra: str, kube: tuple[Path, Path] | None = None) -> AgentProcess:
        """``kube``: (kubeconfig, pod-resources socket) for Kubernetes mode."""
        plugin_dir, sim_dir = short_dir / "dp", short_dir / "sim"
        log_path = short_dir / f"agent{len(started)}.log"
        cmd = sim_agent_command(spec, plugin_dir, sim_dir, node_name="test-node", kube=kube, extra=extra)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        agent = AgentProcess(proc, plugin_dir, sim_dir, log_path)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


@pytest.fixture
def kubelet(short_dir: Path) -> Iterator[KubeletEmulator]:
    emulator = KubeletEmulator(short_dir / "dp")
    emulator.start()
    yield emulator
    emulator.stop()
