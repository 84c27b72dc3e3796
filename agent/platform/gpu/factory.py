"""Choosing the GPU backend: simulated when a spec is given, NVML otherwise."""

from __future__ import annotations

from pathlib import Path

from agent.platform.gpu.inventory import GpuBackend
from agent.platform.gpu.nvml import open_nvml_backend
from agent.platform.gpu.sim.backend import SimulatedBackend


def open_backend(
    simulate: str | None,
    node_name: str,
    sim_state_dir: Path,
    driver_root: Path | None = None,
) -> GpuBackend:
    """``driver_root``: where this process sees the driver's files, searched for NVML when
    the library is not found by name."""
    if simulate:
        return SimulatedBackend(simulate, node_name, sim_state_dir)
    return open_nvml_backend(driver_root=driver_root)
