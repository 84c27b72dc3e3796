"""``FakeNvml`` with NVML's MIG read functions, as nvidia-ml-py 13 shapes them.

Each MIG-capable GPU's state is a :class:`agent.platform.gpu.sim.mig.MigGpu` (the simulated
driver's, so the tables and rules are the same): tests set a geometry through it
(``mig(index)``), and the NVML functions read it back as pynvml returns it: modes as
``[current, pending]``, ctypes handles for MIG devices, GPU instances and compute
instances, pynvml's own info structs (``c_nvmlGpuInstanceInfo_t``, the v2 profile infos with
their ``name``), and ``pynvml.NVMLError(code)`` for a refusal.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pynvml

from agent.platform.gpu.migprofiles import Placement, product
from agent.platform.gpu.sim.mig import MigError, MigGpu
from tests.fakes.fake_nvml import FakeGpu, FakeNvml, _address, _error

_MIG_BASE = 0x7E00_0000_0000  # MIG device handles: + gpu << 16 | gi << 8 | ci << 4
_GI_BASE = 0x7D00_0000_0000  # GPU instance handles: + gpu << 16 | gi << 8
_CI_BASE = 0x7C00_0000_0000  # compute instance handles: + gpu << 16 | gi << 8 | ci << 4


class FakeMigNvml(FakeNvml):
    """``mig``: GPU index -> MIG product key ("H100-80GB") for the MIG-capable GPUs."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        topology: Mapping[tuple[int, int], int] | None = None,
        missing: Iterable[str] = (),
        mig: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(gpus, topology, missing)
        self._mig = {
            index: MigGpu(index, gpu.minor, gpu.uuid, product((mig or {}).get(index, "")))
            for index, gpu in enumerate(gpus)
        }
        self.mig_busy: dict[int, str] = {}  # GPU index -> why a mode change is IN_USE
        self.c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def mig(self, index: int) -> MigGpu:
        """GPU ``index``'s MIG state, to set a mode and geometry as a test needs."""
        return self._mig[index]

    # --- internals --------------------------------------------------------------------
    def _gpu(self, name: str, handle: Any) -> MigGpu:
        index, _ = self._device(name, handle)
        return self._mig[index]

    @staticmethod
    def _decode(handle: Any, base: int) -> tuple[int, int, int]:
        rest = _address(handle) - base
        return rest >> 16, (rest >> 8) & 0xFF, (rest >> 4) & 0xF

    def _is_mig(self, handle: Any) -> bool:
        return isinstance(handle, pynvml.c_nvmlDevice_t) and 0 <= _address(handle) - _MIG_BASE < 1 << 32

    def _mig_handle(self, name: str, handle: Any) -> tuple[MigGpu, int, int]:
        with self._cond:
            self._enter(name)
        gpu, gi, ci = self._decode(handle, _MIG_BASE)
        return self._mig[gpu], gi, ci

    @staticmethod
    def _pointer(address: int, kind: Any) -> Any:
        return ctypes.cast(ctypes.c_void_p(address), kind)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except MigError as err:
            raise _error(err.code) from err

    # --- MIG ----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetMigMode", device)
        self._call(gpu.require_capable)
        return [int(gpu.current), int(gpu.pending)]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return 7 if gpu.product is not None and gpu.current else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        devices = gpu.device_list()
        if index >= len(devices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = devices[index]
        return self._pointer(_MIG_BASE + (gpu.index << 16 | gi.id << 8 | ci.id << 4), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig_handle("nvmlDeviceGetGpuInstanceId", device)[1]

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig_handle("nvmlDeviceGetComputeInstanceId", device)[2]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if self._is_mig(handle):
            gpu, gi, ci = self._mig_handle("nvmlDeviceGetUUID", handle)
            return gpu.gis[gi].cis[ci].uuid
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if not self._is_mig(handle):
            return super().nvmlDeviceGetMemoryInfo(handle, version)
        gpu, gi, _ = self._mig_handle("nvmlDeviceGetMemoryInfo", handle)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = gpu.gis[gi].profile.memory_mib << 20
        memory.used, memory.free = 0, memory.total
        return memory

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", device)
        found = self._call(gpu.profile, profile)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = found.id, found.slices, found.instance_count
        info.multiprocessorCount, info.memorySizeMB = found.sm_count, found.memory_mib
        info.name = found.nvml_name.encode()
        return info

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetGpuInstanceById", device)
        self._call(gpu.gi, gpuInstanceId)
        return self._pointer(_GI_BASE + (gpu.index << 16 | gpuInstanceId << 8), pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        index, gi_id, _ = self._decode(gpuInstance, _GI_BASE)
        gi = self._call(self._mig[index].gi, gi_id)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi.id, gi.profile.id
        info.placement.start, info.placement.size = gi.placement.start, gi.placement.size
        return info

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        index, gi_id, _ = self._decode(gpuInstance, _GI_BASE)
        self._call(self._mig[index].ci, gi_id, computeInstanceId)
        address = _CI_BASE + (index << 16 | gi_id << 8 | computeInstanceId << 4)
        return self._pointer(address, pynvml.c_nvmlComputeInstance_t)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        index, gi_id, ci_id = self._decode(computeInstance, _CI_BASE)
        ci = self._call(self._mig[index].ci, gi_id, ci_id)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.id, info.profileId = ci.id, ci.profile.index
        info.placement.start, info.placement.size = ci.placement.start, ci.placement.size
        return info

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        index, gi_id, _ = self._decode(device, _GI_BASE)
        found = self._call(self._mig[index].ci_profile, gi_id, profile)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = found.index, found.slices, found.instance_count
        info.multiprocessorCount = found.sm_count
        info.name = f"MIG {found.name}".encode()
        return info

    # --- MIG changes --------------------------------------------------------------------
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceSetMigMode", device)
        return int(self._call(gpu.set_mode, mode, self.mig_busy.get(gpu.index)))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceCreateGpuInstanceWithPlacement", device)
        place = placement._obj  # pynvml passes a pointer (ctypes.byref) to the placement struct
        gi = self._call(gpu.create_gi, profileId, Placement(place.start, place.size))
        return self._pointer(_GI_BASE + (gpu.index << 16 | gi.id << 8), pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        index, gi_id, _ = self._decode(gpuInstance, _GI_BASE)
        ci = self._call(self._mig[index].create_ci, gi_id, profileId)
        address = _CI_BASE + (index << 16 | gi_id << 8 | ci.id << 4)
        return self._pointer(address, pynvml.c_nvmlComputeInstance_t)

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        index, gi_id, ci_id = self._decode(computeInstance, _CI_BASE)
        self._call(self._mig[index].destroy_ci, gi_id, ci_id, None)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        index, gi_id, _ = self._decode(gpuInstance, _GI_BASE)
        self._call(self._mig[index].destroy_gi, gi_id)
        return int(pynvml.NVML_SUCCESS)
