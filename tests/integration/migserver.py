"""A node's simulated GPU server started with GPUs in MIG mode, for the agent to attach to:
the MIG tests' shared set-up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.errors import VcudaError
from agent.platform.gpu.sim.client import NodeClient
from tests.integration.kubecluster import wait_until


@contextmanager
def mig_gpu_server(sim_dir: Path, spec: str, node: str, mig: str, timeout_s: float = 30) -> Iterator[Path]:
    """``vcuda-agent sim-gpu --simulate spec --mig mig`` on ``sim_dir``, answering; stopped
    on exit. Yields ``sim_dir``."""
    cmd = [sys.executable, "-m", "agent", "sim-gpu", "--simulate", spec, "--node-name", node]
    proc = subprocess.Popen([*cmd, "--sim-state-dir", str(sim_dir), "--mig", mig])
    try:
        wait_until(lambda: answers(sim_dir), timeout_s, "the GPU server")
        yield sim_dir
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def answers(sim_dir: Path) -> bool:
    """Whether the GPU server on ``sim_dir`` answers (it may still be starting)."""
    try:
        client = NodeClient(sim_dir / "gpu.sock", timeout_s=1.0)
    except VcudaError:
        return False
    try:
        return bool(client.node_info())
    finally:
        client.close()
