"""Driver-native limits through NVML: per-cgroup GPU memory limits and the MPS daemon's
compute mode.

``nvmlDeviceSetMemoryLimits_v1`` (recent drivers, R615+; Linux, cgroup v2, not MIG; root)
sets a soft and a hard limit of GPU memory for the processes of one cgroup, named by its
full sysfs path; an allocation over the hard limit fails with out-of-memory. nvidia-ml-py
binds it whether or not the driver has it, so support is probed by looking the symbol up
in the loaded library (FUNCTION_NOT_FOUND: an older driver).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

SET_LIMITS = "nvmlDeviceSetMemoryLimits_v1"
NO_LIMIT = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: the hard limit that means none


def limits_support(nvml: ModuleType) -> str | None:
    """Why this NVML cannot set per-cgroup memory limits (None: it can)."""
    if not hasattr(nvml, SET_LIMITS) or not hasattr(nvml, "c_nvmlSetMemoryLimits_v1_t"):
        return f"nvidia-ml-py has no {SET_LIMITS} (upgrade nvidia-ml-py)"
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        return None  # a binding that resolves symbols itself: the call tells
    try:
        lookup(SET_LIMITS)
    except nvml.NVMLError as err:
        return f"the driver's NVML has no {SET_LIMITS} (R615 or later needed): {err}"
    return None


def set_cgroup_limit(nvml: ModuleType, handle: Any, cgroup: Path, limit_bytes: int | None) -> None:
    """Hard limit (and soft limit, the same) for ``cgroup``; None clears both."""
    limits = nvml.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace = str(cgroup).encode()
    limits.softLimit = 0 if limit_bytes is None else limit_bytes
    limits.hardLimit = NO_LIMIT if limit_bytes is None else limit_bytes
    getattr(nvml, SET_LIMITS)(handle, limits)


def mps_client_processes(nvml: ModuleType, handle: Any) -> list[Any]:
    """MPS clients' processes (their memory); [] where the binding or driver has no call."""
    for name in (
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses",
    ):
        call = getattr(nvml, name, None)
        if call is None:
            continue
        try:
            return list(call(handle))
        except nvml.NVMLError:
            return []
    return []
