"""Choosing the GPU backend: simulated when a spec is given, NVML otherwise.

Each backend is imported only when chosen: on a real node the simulator is never loaded
(docs/architecture.md, "What the production path loads")."""

from __future__ import annotations

from pathlib import Path

from agent.platform.gpu.inventory import GpuBackend


def open_backend(
    simulate: str | None,
    node_name: str,
    sim_state_dir: Path,
    driver_root: Path | None = None,
) -> GpuBackend:
    """``driver_root``: where this process sees the driver's files, searched for NVML when
    the library is not found by name."""
    if simulate:
        from agent.platform.gpu.sim.backend import SimulatedBackend  # noqa: PLC0415

        return SimulatedBackend(simulate, node_name, sim_state_dir)
    from agent.platform.gpu.nvml import open_nvml_backend  # noqa: PLC0415

    return open_nvml_backend(driver_root=driver_root)
