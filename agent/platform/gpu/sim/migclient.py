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

from dataclasses import dataclass
from pathlib import Path
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
class GpuInstanceProfileInfo:
    """``nvmlGpuInstanceProfileInfo_v2_t``'s fields (those the simulator knows)."""

    id: int
    isP2pSupported: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    copyEngineCount: int
    memorySizeMB: int
    name: str


@dataclass(frozen=True)
class ComputeInstanceProfileInfo:
    id: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    name: str


@dataclass(frozen=True)
class GpuInstanceInfo:
    device: int
    id: int
    profileId: int
    placement: Placement


@dataclass(frozen=True)
class ComputeInstanceInfo:
    device: int
    gpuInstance: int
    id: int
    profileId: int
    placement: Placement


@dataclass(frozen=True)
class MemoryInfo:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class GpmSample:
    timestamp: float  # wall seconds
    sm_busy_s: float  # SM-busy seconds of the GPU instance so far


Device = int | MigDeviceHandle


def gpm_sm_util(first: GpmSample, second: GpmSample) -> float:
    """The GPU instance's SM activity between two samples, percent (GPM's SM_UTIL)."""
    span = second.timestamp - first.timestamp
    if span <= 0:
        raise ValueError("GPM samples must be taken in order, some time apart")
    return max(0.0, min(100.0, 100 * (second.sm_busy_s - first.sm_busy_s) / span))


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

    # Mode ---------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: int) -> list[int]:
        reply = self._call("nvmlDeviceGetMigMode", device)
        return [int(reply["current"]), int(reply["pending"])]

    def nvmlDeviceSetMigMode(self, device: int, mode: int) -> int:
        """The activation status: NVML_ERROR_RESET_REQUIRED while the new mode is pending."""
        return int(self._call("nvmlDeviceSetMigMode", device, mode=mode)["activation"])

    # GPU instances ------------------------------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: int, profile: int) -> GpuInstanceProfileInfo:
        info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", device, profile=profile)["info"]
        return GpuInstanceProfileInfo(**info)

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

    def nvmlGpuInstanceGetInfo(self, gpuInstance: GpuInstanceHandle) -> GpuInstanceInfo:
        gi = self._call("nvmlDeviceGetGpuInstanceById", gpuInstance.gpu, gi=gpuInstance.id)["gi"]
        return GpuInstanceInfo(gi["device"], gi["id"], gi["profileId"], Placement(*gi["placement"]))

    def nvmlGpuInstanceDestroy(self, gpuInstance: GpuInstanceHandle) -> None:
        self._call("nvmlGpuInstanceDestroy", gpuInstance.gpu, gi=gpuInstance.id)

    # Compute instances --------------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: GpuInstanceHandle, profile: int, engProfile: int = 0
    ) -> ComputeInstanceProfileInfo:
        reply = self._call(
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            gpuInstance.gpu,
            gi=gpuInstance.id,
            profile=profile,
            eng_profile=engProfile,
        )
        return ComputeInstanceProfileInfo(**reply["info"])

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> int:
        reply = self._call(
            "nvmlGpuInstanceGetComputeInstanceRemainingCapacity",
            gpuInstance.gpu,
            gi=gpuInstance.id,
            profile_id=profileId,
        )
        return int(reply["count"])

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> ComputeInstanceHandle:
        reply = self._call(
            "nvmlGpuInstanceCreateComputeInstance", gpuInstance.gpu, gi=gpuInstance.id, profile_id=profileId
        )
        return ComputeInstanceHandle(gpuInstance.gpu, gpuInstance.id, int(reply["ci"]["id"]))

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gpuInstance: GpuInstanceHandle, profileId: int, placement: Placement
    ) -> ComputeInstanceHandle:
        reply = self._call(
            "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
            gpuInstance.gpu,
            gi=gpuInstance.id,
            profile_id=profileId,
            placement=[placement.start, placement.size],
        )
        return ComputeInstanceHandle(gpuInstance.gpu, gpuInstance.id, int(reply["ci"]["id"]))

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> list[ComputeInstanceHandle]:
        reply = self._call(
            "nvmlGpuInstanceGetComputeInstances", gpuInstance.gpu, gi=gpuInstance.id, profile_id=profileId
        )
        return [ComputeInstanceHandle(gpuInstance.gpu, gpuInstance.id, int(c["id"])) for c in reply["cis"]]

    def nvmlComputeInstanceGetInfo(self, computeInstance: ComputeInstanceHandle) -> ComputeInstanceInfo:
        ci = self._call(
            "nvmlGpuInstanceGetComputeInstanceById",
            computeInstance.gpu,
            gi=computeInstance.gi,
            ci=computeInstance.id,
        )["ci"]
        placement = Placement(*ci["placement"])
        return ComputeInstanceInfo(ci["device"], ci["gpuInstance"], ci["id"], ci["profileId"], placement)

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

    @staticmethod
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: MigDeviceHandle) -> int:
        return _mig(migDevice).gpu

    @staticmethod
    def nvmlDeviceGetGpuInstanceId(device: MigDeviceHandle) -> int:
        return _mig(device).gi

    @staticmethod
    def nvmlDeviceGetComputeInstanceId(device: MigDeviceHandle) -> int:
        return _mig(device).ci

    @staticmethod
    def nvmlDeviceGetUUID(device: MigDeviceHandle) -> str:
        return _mig(device).uuid

    def nvmlDeviceGetMemoryInfo(self, device: MigDeviceHandle) -> MemoryInfo:
        mig = _mig(device)
        reply = self._call("nvmlDeviceGetMemoryInfo", mig.gpu, uuid=mig.uuid)
        return MemoryInfo(int(reply["total"]), int(reply["used"]), int(reply["free"]))

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
