"""Where bench/gpu_suite.py reads the GPU: real NVML (pynvml, GPU 0) or the project's
simulated GPU (``--simulate``), behind one small interface that returns NVML's answers raw,
entry by entry, for the traces to keep as they came.

The simulated backend has no per-process or device memory utilization: those come back as
None (null in the traces), never as a made-up 0.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from gpu_inventory import device_samples, process_utilization, text

SIM_SPEC = "1xH100-80GB"
SIM_NODE = "gpu-suite"


class Source(Protocol):
    simulated: bool
    gpu_name: str
    gpu_uuid: str
    driver: str

    def proc(self, since_us: int) -> list[list[Any]]:
        """nvmlDeviceGetProcessUtilization: [pid, timeStamp µs, smUtil, memUtil] each."""
        ...

    def dev(self, since_us: int) -> list[list[Any]]:
        """nvmlDeviceGetSamples(GPU_UTILIZATION_SAMPLES): [timeStamp µs, value] each."""
        ...

    def util(self) -> tuple[int, int | None]:
        """nvmlDeviceGetUtilizationRates: (gpu %, memory %)."""
        ...

    def close(self) -> None: ...


class NvmlSource:
    """GPU 0 of an initialized pynvml (closed with it)."""

    simulated = False

    def __init__(self, nvml: ModuleType) -> None:
        self._nvml = nvml
        self._handle = nvml.nvmlDeviceGetHandleByIndex(0)
        self.gpu_name = text(nvml.nvmlDeviceGetName(self._handle))
        self.gpu_uuid = text(nvml.nvmlDeviceGetUUID(self._handle))
        try:
            self.driver = text(nvml.nvmlSystemGetDriverVersion())
        except Exception as err:  # noqa: BLE001  (a label only: the traces are worth more)
            self.driver = f"unknown ({err})"

    def proc(self, since_us: int) -> list[list[Any]]:
        return [list(s) for s in process_utilization(self._nvml, self._handle, since_us)]

    def dev(self, since_us: int) -> list[list[Any]]:
        return [list(s) for s in device_samples(self._nvml, self._handle, since_us)]

    def util(self) -> tuple[int, int | None]:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        return int(rates.gpu), int(rates.memory)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


class SimSource:
    """GPU 0 of a simulated node whose GPU server the backend starts (and stops at close)."""

    simulated = True
    driver = "simulated"

    def __init__(self, state_dir: Path, server_args: tuple[str, ...] = ()) -> None:
        backend_module = importlib.import_module("agent.platform.gpu.sim.backend")
        self.state_dir = state_dir
        self.backend: Any = backend_module.SimulatedBackend(
            SIM_SPEC, SIM_NODE, state_dir, server_args=server_args
        )
        gpu = self.backend.gpus()[0]
        self.gpu_name = f"{gpu.model} (simulated)"
        self.gpu_uuid = gpu.uuid

    def proc(self, since_us: int) -> list[list[Any]]:
        return [[s.pid, s.timestamp_us, s.sm_util, None] for s in self.backend.process_samples(0, since_us)]

    def dev(self, since_us: int) -> list[list[Any]]:
        return [[s.timestamp_us, s.util] for s in self.backend.device_samples(0, since_us)]

    def util(self) -> tuple[int, int | None]:
        return int(self.backend.device_utilization(0)), None

    def close(self) -> None:
        self.backend.close()
