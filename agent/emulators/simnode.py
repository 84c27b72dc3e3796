"""The command line of a simulated GPU node: `vcuda-agent run --simulate ...` as a real
process (with `--no-kube`, or pointed at an API server by a kubeconfig), for the demo,
tests and benchmarks."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from agent.emulators.kubelet import KubeletEmulator


def sim_agent_command(
    spec: str | None,
    plugin_dir: Path,
    sim_dir: Path,
    *,
    node_name: str = "sim-node",
    metrics_address: str | None = "127.0.0.1:0",
    kube: tuple[Path, Path] | None = None,
    state_dir: Path | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """``spec`` None: the real GPUs through NVML. ``kube``: (kubeconfig, pod-resources
    socket) for Kubernetes mode; None: ``--no-kube``."""
    cmd = [sys.executable, "-m", "agent", "run", "--node-name", node_name]
    if spec is not None:
        cmd += ["--simulate", spec]
    if kube is None:
        cmd.append("--no-kube")
    else:
        cmd += ["--kubeconfig", str(kube[0]), "--pod-resources-socket", str(kube[1])]
    cmd += ["--device-plugin-dir", str(plugin_dir), "--sim-state-dir", str(sim_dir)]
    cmd += ["--metrics-address", metrics_address] if metrics_address else ["--no-metrics"]
    # Freeze journal and status socket of this node alone: agents of other tests and demos
    # running at the same time must not thaw each other's containers at start-up.
    cmd += ["--state-dir", str(state_dir or plugin_dir.parent / "agent-state")]
    # Its MPS daemons' pipe and log directories too (used in sharing modes mps and auto).
    cmd += ["--mps-root", str(plugin_dir.parent / "mps")]
    if kube is not None and "--cgroup-root" not in extra and "--device-guard" not in extra:
        # On the host's own cgroups the device guard would gate every pod under the real
        # kubepods that this simulated node does not know (another test's containers, a
        # real node's pods) to no GPU at all: it acts only where the node's cgroups are its own.
        cmd += ["--device-guard", "off"]
    return [*cmd, *extra]


@contextlib.contextmanager
def running_sim_node(
    spec: str, workdir: Path, *, extra: tuple[str, ...] = ("--log-level", "WARNING", "--no-ioctl-tracing")
) -> Iterator[tuple[subprocess.Popen[bytes], KubeletEmulator]]:
    """A kubelet emulator and a simulated agent (no metrics, no ioctl tracer: the benches
    measure the device plugin) in ``workdir``; the agent is
    stopped with SIGTERM and the emulator stopped on exit."""
    kubelet = KubeletEmulator(workdir / "dp")
    kubelet.start()
    try:
        agent = subprocess.Popen(
            sim_agent_command(spec, workdir / "dp", workdir / "sim", metrics_address=None, extra=extra)
        )
        try:
            yield agent, kubelet
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
    finally:
        kubelet.stop()
