"""``vcuda-agent run`` as a real process on each cell's node: started in the private
containerd's mount namespace (the node's cgroup layout) with that containerd's socket under
``--host-root``, it finds the layout, the cgroupfs driver from the runtime-made ``kubepods``
and the runtime endpoint from the real socket, says so at start-up, and stops cleanly.

(Its start-up thaw of a journal left behind runs with enforcement, in Kubernetes mode; the
freeze path on runtime containers is in test_matrix.py.)"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent.emulators.simnode import sim_agent_command
from tests.runtime.containerd import SOCKET_IN_HOST_ROOT, PrivateContainerd

pytestmark = pytest.mark.privileged


def wait_for_line(log: Path, proc: subprocess.Popen[bytes], text: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace")
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the agent's log: {log.read_text(errors='replace')[-2000:]}")


def test_the_agent_finds_the_layout_driver_and_runtime_of_a_real_node(
    containerd: PrivateContainerd, tmp_path: Path
) -> None:
    box = containerd.run()  # kubelet's kubepods parent exists once a pod runs
    workdir = containerd.workdir / f"agent-{time.monotonic_ns()}"
    (workdir / "dp").mkdir(parents=True)
    command = sim_agent_command(
        "1xH100-80GB",
        workdir / "dp",
        workdir / "sim",
        metrics_address=None,
        extra=("--host-root", str(containerd.host_root), "--kubelet-config", str(workdir / "no-config.yaml")),
    )
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            containerd.in_namespace(*command),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).parents[2],
        )
    try:
        text = wait_for_line(log, agent, "host: container runtime:")
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=30)
    mode = "v2" if containerd.cgroup == "v2" else "v1"
    assert f"host: cgroup layout: {mode} (from /proc/self/mountinfo)" in text
    assert "host: cgroup driver: cgroupfs (from found /sys/fs/cgroup/" in text
    socket = containerd.host_root / SOCKET_IN_HOST_ROOT
    assert (
        f"host: container runtime: containerd at unix:///{SOCKET_IN_HOST_ROOT} (from found {socket})" in text
    )
    assert code == 0, log.read_text(errors="replace")[-2000:]
    assert containerd.exec(box, "/bin/true").returncode == 0
