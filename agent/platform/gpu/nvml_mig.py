"""A GPU's MIG mode and MIG devices through NVML, read-only.

``nvmlDeviceGetMigMode`` gives the current and the pending mode (NOT_SUPPORTED: no MIG on
this GPU). In MIG mode each MIG device is found by ``nvmlDeviceGetMigDeviceHandleByIndex``
up to ``nvmlDeviceGetMaxMigDeviceCount`` (NOT_FOUND: no device at that index), and named by
its GPU and compute instance: ``nvmlDeviceGetGpuInstanceId`` / ``...ComputeInstanceId``,
``nvmlDeviceGetGpuInstanceById`` + ``nvmlGpuInstanceGetInfo`` (profile, placement),
``nvmlGpuInstanceGetComputeInstanceById`` + ``nvmlComputeInstanceGetInfo`` and the
profiles' info (names, SMs). The capability device nodes come from
``/proc/driver/nvidia-caps/mig-minors`` (their numbering is fixed: migprofiles). Nothing
here changes the GPU. NVML errors propagate; the backend translates them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from agent.errors import PlatformError
from agent.platform.gpu.migprofiles import GI_PROFILE_COUNT, ci_cap_minor, gi_cap_minor
from agent.platform.gpu.migstate import NOT_CAPABLE, MigDevice, MigInfo
from agent.platform.gpu.nvml_topology import text

log = logging.getLogger(__name__)

MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
_MIB = 1 << 20


def read_minors(path: Path = MIG_MINORS) -> dict[str, int]:
    """``mig-minors`` as {capability name: minor}; {} when the file is not there."""
    try:
        content = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise PlatformError(f"cannot read {path}: {err}") from err
    minors: dict[str, int] = {}
    for line in content.splitlines():
        name, _, number = line.strip().rpartition(" ")
        if name and number.isdigit():
            minors[name] = int(number)
    return minors


def read_mig(nvml: ModuleType, handle: Any, index: int, gpu_minor: int, minors: dict[str, int]) -> MigInfo:
    """The GPU's MIG state (``minors``: :func:`read_minors`, {} to number by the rule)."""
    get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
    if get_mode is None:
        return NOT_CAPABLE  # an nvidia-ml-py without MIG
    unsupported = {int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)}
    try:
        current, pending = get_mode(handle)
    except nvml.NVMLError as err:
        if int(err.value) in unsupported:
            return NOT_CAPABLE
        raise
    enable = int(nvml.NVML_DEVICE_MIG_ENABLE)
    if int(current) != enable:
        return MigInfo(True, False, int(pending) == enable)
    reader = _Reader(nvml, handle, index, gpu_minor, _gi_profile_names(nvml, handle), minors)
    devices = []
    for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except nvml.NVMLError as err:
            if int(err.value) == int(nvml.NVML_ERROR_NOT_FOUND):
                continue  # no MIG device at this index
            raise
        devices.append(reader.device(mig, i))
    return MigInfo(True, True, int(pending) == enable, tuple(devices))


@dataclass(frozen=True)
class _Reader:
    nvml: ModuleType
    handle: Any
    index: int
    gpu_minor: int
    names: dict[int, str]  # GPU instance profile id -> name
    minors: dict[str, int]

    def device(self, mig: Any, device_index: int) -> MigDevice:
        nvml = self.nvml
        gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        gi_handle = nvml.nvmlDeviceGetGpuInstanceById(self.handle, gi)
        gi_info = nvml.nvmlGpuInstanceGetInfo(gi_handle)
        ci_info = nvml.nvmlComputeInstanceGetInfo(nvml.nvmlGpuInstanceGetComputeInstanceById(gi_handle, ci))
        ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi_handle, int(ci_info.profileId), int(nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        )
        gi_name = self.names.get(int(gi_info.profileId), f"profile-{int(gi_info.profileId)}")
        n = self.gpu_minor
        return MigDevice(
            gpu_index=self.index,
            device_index=device_index,
            gi=gi,
            ci=ci,
            uuid=text(nvml.nvmlDeviceGetUUID(mig)),
            profile=_profile_name(ci_profile) or gi_name,
            gi_profile=gi_name,
            gi_profile_id=int(gi_info.profileId),
            ci_profile_id=int(ci_info.profileId),
            placement_start=int(gi_info.placement.start),
            placement_size=int(gi_info.placement.size),
            memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(mig).total) // _MIB,
            sm_count=int(ci_profile.multiprocessorCount),
            gi_cap_minor=self.minors.get(f"gpu{n}/gi{gi}/access", _rule(gi_cap_minor, n, gi)),
            ci_cap_minor=self.minors.get(f"gpu{n}/gi{gi}/ci{ci}/access", _rule(ci_cap_minor, n, gi, ci)),
        )


def _gi_profile_names(nvml: ModuleType, handle: Any) -> dict[int, str]:
    """{GPU instance profile id: name} of the profiles this GPU offers."""
    names: dict[int, str] = {}
    count = int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", GI_PROFILE_COUNT))
    skip = {int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_INVALID_ARGUMENT)}
    for profile in range(count):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except nvml.NVMLError as err:
            if int(err.value) in skip:
                continue  # a profile this product does not have
            raise
        names[int(info.id)] = _profile_name(info) or (
            f"{int(info.sliceCount)}g.{math.ceil(int(info.memorySizeMB) / 1024)}gb"
        )
    return names


def _profile_name(info: Any) -> str:
    """The profile's name as the v2 info gives it ("MIG 1g.10gb" -> "1g.10gb"), or ""."""
    raw = getattr(info, "name", b"")
    return text(raw).strip().removeprefix("MIG ").strip() if raw else ""


def _rule(fn: Any, *ids: int) -> int | None:
    try:
        return int(fn(*ids))
    except ValueError:
        log.warning("no nvidia-caps minor for ids %s", ids)
        return None
