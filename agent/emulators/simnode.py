"""The command line of a simulated GPU node: `vcuda-agent run --no-kube --simulate ...`
as a real process, for the demo, tests and benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path


def sim_agent_command(
    spec: str,
    plugin_dir: Path,
    sim_dir: Path,
    *,
    node_name: str = "sim-node",
    metrics_address: str | None = "127.0.0.1:0",
    extra: tuple[str, ...] = (),
) -> list[str]:
    cmd = [sys.executable, "-m", "agent", "run", "--no-kube", "--simulate", spec, "--node-name", node_name]
    cmd += ["--device-plugin-dir", str(plugin_dir), "--sim-state-dir", str(sim_dir)]
    cmd += ["--metrics-address", metrics_address] if metrics_address else ["--no-metrics"]
    return [*cmd, *extra]
