"""NVML's MIG functions against the simulated GPUs, under pynvml's names and with its
semantics: a refused call raises :class:`~agent.errors.NvmlError` with NVML's return code
(``IN_USE``, ``INSUFFICIENT_RESOURCES``, ``NOT_SUPPORTED``, ``INVALID_ARGUMENT``,
``NOT_FOUND``), as ``pynvml.NVMLError`` carries it.

Handles: a GPU is its index (what ``nvmlDeviceGetHandleByIndex`` stands for); GPU
instances, compute instances and MIG devices are small frozen records. Where pynvml fills
C arrays (``nvmlDeviceGetGpuInstancePossiblePlacements``, ``nvmlDeviceGetGpuInstances``)
these return lists. ``nvmlGpmMigSampleGet`` and :func:`gpm_sm_util` stand in for GPM's
per-GPU-instance SM activity (``NVML_GPM_METRIC_SM_UTIL`` between two samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agent.errors import NvmlError, SimulationError
from agent.platform.gpu.migprofiles import Placement
from agent.platform.gpu.nvmlcodes import NVML_ERROR_INVALID_ARGUMENT
from agent.platform.gpu.sim.client import Connection


@dataclass(frozen=True)
class GpuInstanceHandle:
    gpu: int
    id: int


@dataclass(frozen=True)
class ComputeInstanceHandle:
    gpu: int
    gi: int
    id: int


@dataclass(frozen=True)
class MigDeviceHandle:
    gpu: int
    index: int
    gi: int
    ci: int
    uuid: str


@dataclass(frozen=True)
class GpmSample:
    timestamp: float  # wall seconds
    sm_busy_s: float  # SM-busy seconds of the GPU instance so far


Device = int | MigDeviceHandle
Struct = SimpleNamespace  # an NVML structure (``c_nvmlGpuInstanceInfo_t``...): pynvml's field names


def gpm_sm_util(first: GpmSample, second: GpmSample) -> float:
    """The GPU instance's SM activity between two samples, percent (GPM's SM_UTIL)."""
    span = second.timestamp - first.timestamp
    if span <= 0:
        raise ValueError("GPM samples must be taken in order, some time apart")
    return max(0.0, min(100.0, 100 * (second.sm_busy_s - first.sm_busy_s) / span))


def _handle_field(name: str) -> Callable[[object], Any]:
    def read(device: object) -> Any:
        return getattr(_mig(device), name)

    return read


class SimNvml:
    """The NVML MIG calls of the simulated node served at ``socket_path``."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0) -> None:
        self._conn = Connection(socket_path, timeout_s)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SimNvml:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _call(self, call: str, gpu: int, **fields: Any) -> dict[str, Any]:
        self._conn.send({"op": "nvml", "call": call, "gpu": gpu, **fields})
        reply = self._conn.receive()
        if reply.get("ok"):
            return reply
        code = reply.get("nvml")
        error = str(reply.get("error") or f"{call} failed")
        if isinstance(code, int) and not isinstance(code, bool):
            raise NvmlError(code, f"{call}: {error}", gpu)
        raise SimulationError(f"{call} on GPU {gpu}: {error}")

    def _on_gi(self, call: str, gpuInstance: GpuInstanceHandle, **fields: Any) -> dict[str, Any]:
        return self._call(call, gpuInstance.gpu, gi=gpuInstance.id, **fields)

    def _new_ci(self, call: str, gpuInstance: GpuInstanceHandle, **fields: Any) -> ComputeInstanceHandle:
        ci = self._on_gi(call, gpuInstance, **fields)["ci"]
        return ComputeInstanceHandle(gpuInstance.gpu, gpuInstance.id, int(ci["id"]))

    # Mode ---------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: int) -> list[int]:
        reply = self._call("nvmlDeviceGetMigMode", device)
        return [int(reply["current"]), int(reply["pending"])]

    def nvmlDeviceSetMigMode(self, device: int, mode: int) -> int:
        """The activation status: NVML_ERROR_RESET_REQUIRED while the new mode is pending."""
        return int(self._call("nvmlDeviceSetMigMode", device, mode=mode)["activation"])

    # GPU instances ------------------------------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: int, profile: int) -> Struct:
        info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", device, profile=profile)["info"]
        return Struct(**info)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: int, profileId: int) -> list[Placement]:
        reply = self._call("nvmlDeviceGetGpuInstancePossiblePlacements", device, profile_id=profileId)
        return [Placement(int(s), int(z)) for s, z in reply["placements"]]

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: int, profileId: int) -> int:
        reply = self._call("nvmlDeviceGetGpuInstanceRemainingCapacity", device, profile_id=profileId)
        return int(reply["count"])

    def nvmlDeviceCreateGpuInstance(self, device: int, profileId: int) -> GpuInstanceHandle:
        reply = self._call("nvmlDeviceCreateGpuInstance", device, profile_id=profileId)
        return GpuInstanceHandle(device, int(reply["gi"]["id"]))

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: int, profileId: int, placement: Placement
    ) -> GpuInstanceHandle:
        reply = self._call(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            device,
            profile_id=profileId,
            placement=[placement.start, placement.size],
        )
        return GpuInstanceHandle(device, int(reply["gi"]["id"]))

    def nvmlDeviceGetGpuInstances(self, device: int, profileId: int) -> list[GpuInstanceHandle]:
        reply = self._call("nvmlDeviceGetGpuInstances", device, profile_id=profileId)
        return [GpuInstanceHandle(device, int(g["id"])) for g in reply["gis"]]

    def nvmlDeviceGetGpuInstanceById(self, device: int, gpuInstanceId: int) -> GpuInstanceHandle:
        reply = self._call("nvmlDeviceGetGpuInstanceById", device, gi=gpuInstanceId)
        return GpuInstanceHandle(device, int(reply["gi"]["id"]))

    def nvmlGpuInstanceGetInfo(self, gpuInstance: GpuInstanceHandle) -> Struct:
        gi = self._on_gi("nvmlDeviceGetGpuInstanceById", gpuInstance)["gi"]
        return Struct(**{**gi, "placement": Placement(*gi["placement"])})

    def nvmlGpuInstanceDestroy(self, gpuInstance: GpuInstanceHandle) -> None:
        self._on_gi("nvmlGpuInstanceDestroy", gpuInstance)

    # Compute instances --------------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: GpuInstanceHandle, profile: int, engProfile: int = 0
    ) -> Struct:
        call = "nvmlGpuInstanceGetComputeInstanceProfileInfo"
        return Struct(**self._on_gi(call, gpuInstance, profile=profile, eng_profile=engProfile)["info"])

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> int:
        call = "nvmlGpuInstanceGetComputeInstanceRemainingCapacity"
        return int(self._on_gi(call, gpuInstance, profile_id=profileId)["count"])

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> ComputeInstanceHandle:
        return self._new_ci("nvmlGpuInstanceCreateComputeInstance", gpuInstance, profile_id=profileId)

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gpuInstance: GpuInstanceHandle, profileId: int, placement: Placement
    ) -> ComputeInstanceHandle:
        call, where = "nvmlGpuInstanceCreateComputeInstanceWithPlacement", [placement.start, placement.size]
        return self._new_ci(call, gpuInstance, profile_id=profileId, placement=where)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> list[ComputeInstanceHandle]:
        reply = self._on_gi("nvmlGpuInstanceGetComputeInstances", gpuInstance, profile_id=profileId)
        return [ComputeInstanceHandle(gpuInstance.gpu, gpuInstance.id, int(c["id"])) for c in reply["cis"]]

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: GpuInstanceHandle, id: int
    ) -> ComputeInstanceHandle:
        return self._new_ci("nvmlGpuInstanceGetComputeInstanceById", gpuInstance, ci=id)

    def nvmlComputeInstanceGetInfo(self, computeInstance: ComputeInstanceHandle) -> Struct:
        gi = GpuInstanceHandle(computeInstance.gpu, computeInstance.gi)
        ci = self._on_gi("nvmlGpuInstanceGetComputeInstanceById", gi, ci=computeInstance.id)["ci"]
        return Struct(**{**ci, "placement": Placement(*ci["placement"])})

    def nvmlComputeInstanceDestroy(self, computeInstance: ComputeInstanceHandle) -> None:
        self._call(
            "nvmlComputeInstanceDestroy", computeInstance.gpu, gi=computeInstance.gi, ci=computeInstance.id
        )

    # MIG devices --------------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, device: int) -> int:
        return int(self._call("nvmlDeviceGetMaxMigDeviceCount", device)["count"])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: int, index: int) -> MigDeviceHandle:
        d = self._call("nvmlDeviceGetMigDeviceHandleByIndex", device, index=index)["device"]
        return MigDeviceHandle(int(d["gpu"]), int(d["index"]), int(d["gi"]), int(d["ci"]), str(d["uuid"]))

    @staticmethod
    def nvmlDeviceIsMigDeviceHandle(device: Device) -> bool:
        return isinstance(device, MigDeviceHandle)

    # What pynvml reads off a MIG device handle (its parent GPU, GI and CI ids, its UUID).
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle = staticmethod(_handle_field("gpu"))
    nvmlDeviceGetGpuInstanceId = staticmethod(_handle_field("gi"))
    nvmlDeviceGetComputeInstanceId = staticmethod(_handle_field("ci"))
    nvmlDeviceGetUUID = staticmethod(_handle_field("uuid"))

    def nvmlDeviceGetMemoryInfo(self, device: MigDeviceHandle) -> Struct:
        mig = _mig(device)
        reply = self._call("nvmlDeviceGetMemoryInfo", mig.gpu, uuid=mig.uuid)
        return Struct(total=int(reply["total"]), used=int(reply["used"]), free=int(reply["free"]))

    # Utilization --------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, device: Device) -> int:
        """The GPU's utilization; NOT_SUPPORTED on a MIG device or a GPU in MIG mode."""
        gpu, uuid = _target(device)
        fields = {} if uuid is None else {"uuid": uuid}
        return int(self._call("nvmlDeviceGetUtilizationRates", gpu, **fields)["gpu"])

    def nvmlDeviceGetProcessUtilization(self, device: Device, lastSeenTimeStamp: int = 0) -> None:
        """NOT_SUPPORTED on a MIG device or a GPU in MIG mode (otherwise the backend's poll
        reads the samples)."""
        gpu, uuid = _target(device)
        fields: dict[str, Any] = {"since": lastSeenTimeStamp}
        if uuid is not None:
            fields["uuid"] = uuid
        self._call("nvmlDeviceGetProcessUtilization", gpu, **fields)

    def nvmlGpmMigSampleGet(self, device: int, gpuInstanceId: int) -> GpmSample:
        sample = self._call("nvmlGpmMigSampleGet", device, gi=gpuInstanceId)["sample"]
        return GpmSample(float(sample["timestamp"]), float(sample["sm_busy_s"]))


def _mig(device: object) -> MigDeviceHandle:
    if not isinstance(device, MigDeviceHandle):
        raise NvmlError(NVML_ERROR_INVALID_ARGUMENT, f"{device!r} is not a MIG device handle")
    return device


def _target(device: Device) -> tuple[int, str | None]:
    return (device.gpu, device.uuid) if isinstance(device, MigDeviceHandle) else (device, None)
