"""What bench/gpu_suite.py records of each GPU's MIG support (``inventory.json``:
``nvidia.gpus[].mig``), so that the first lent A100, H100 or H200 shows the driver's own
answers next to the tables the agent and the simulated GPU rely on (docs/mig.md): whether the
GPU has MIG, its current and pending mode, every GPU-instance profile the driver offers
(``nvmlDeviceGetGpuInstanceProfileInfo`` for each profile index: name, id, slices, memory,
SMs, instance count and the rest of pynvml's struct), each profile's possible placements and
remaining capacity, and the MIG devices that exist.

Read only, always: nothing here changes the MIG mode or creates or destroys an instance (a
lent GPU is someone else's; a mode change may even need a reset). :data:`READ_CALLS` lists
every NVML function this module calls, and the tests check it calls nothing else.

Each fact is read on its own; an error is written down as the fact (``"error: ..."``).
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT, should the binding lack the name
MAX_PLACEMENTS = 32  # room for a profile's placements (a GPU has 8 memory slices)
MAX_MIG_DEVICES = 7
READ_CALLS = frozenset(
    {
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMemoryInfo",
    }
)


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _fact(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the error as the fact."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001  (the error is the fact recorded)
        return f"error: {type(err).__name__}: {err}"


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def struct_fields(info: Any) -> dict[str, Any]:
    """Every field of one of pynvml's ctypes structs, by its name (bytes as text)."""
    fields = getattr(type(info), "_fields_", None)
    if fields is None:  # not a ctypes struct: its public attributes
        return {k: _text(v) for k, v in vars(info).items() if not k.startswith("_")}
    return {name: _text(getattr(info, name)) for name, *_ in fields}


def mig_facts(nvml: ModuleType, handle: Any) -> dict[str, Any]:
    """One GPU's MIG support and state, read only (the module docstring)."""
    try:
        current, pending = (int(m) for m in nvml.nvmlDeviceGetMigMode(handle))
    except nvml.NVMLError as err:
        if _code(err) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
            return {"capable": False, "reason": f"nvmlDeviceGetMigMode: {err}"}
        return {"capable": f"error: nvmlDeviceGetMigMode: {err}"}
    facts: dict[str, Any] = {
        "capable": True,
        "current": "enabled" if current else "disabled",
        "pending": "enabled" if pending else "disabled",
        "profiles": profiles(nvml, handle),
    }
    facts["devices"] = _fact(mig_devices, nvml, handle) if current else []
    return facts


def profiles(nvml: ModuleType, handle: Any) -> list[dict[str, Any]]:
    """``nvmlDeviceGetGpuInstanceProfileInfo`` for each profile index; an index the GPU does
    not have is listed with NVML's answer."""
    found = []
    for index in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", PROFILE_COUNT))):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except nvml.NVMLError as err:
            found.append({"index": index, "error": f"{err} (code {_code(err)})"})
            continue
        fields = struct_fields(info)
        profile_id = int(fields.get("id", -1))
        found.append(
            {
                "index": index,
                **fields,
                "placements": _fact(placements, nvml, handle, profile_id),
                "remaining": _fact(remaining, nvml, handle, profile_id),
            }
        )
    return found


def remaining(nvml: ModuleType, handle: Any, profile_id: int) -> int:
    """``nvmlDeviceGetGpuInstanceRemainingCapacity``: how many more of the profile fit now."""
    return int(nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile_id))


def placements(nvml: ModuleType, handle: Any, profile_id: int) -> list[str]:
    """``nvmlDeviceGetGpuInstancePossiblePlacements``: each as ``start:size`` on the memory
    slices (pynvml fills a C array and its count)."""
    kind = getattr(nvml, "c_nvmlGpuInstancePlacement_t", None)
    if kind is None:
        raise RuntimeError("the binding has no c_nvmlGpuInstancePlacement_t")
    room = (kind * MAX_PLACEMENTS)()
    count = ctypes.c_uint(MAX_PLACEMENTS)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, room, ctypes.byref(count))
    return [f"{room[i].start}:{room[i].size}" for i in range(min(count.value, MAX_PLACEMENTS))]


def mig_devices(nvml: ModuleType, handle: Any) -> list[dict[str, Any]]:
    """The MIG devices that exist (GPU instance, compute instance, UUID, memory)."""
    devices = []
    for index in range(min(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)), MAX_MIG_DEVICES)):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nvml.NVMLError as err:
            if _code(err) == NVML_ERROR_NOT_FOUND:  # no device at this index
                continue
            raise
        devices.append(
            {
                "index": index,
                "gi": _fact(lambda d=device: int(nvml.nvmlDeviceGetGpuInstanceId(d))),
                "ci": _fact(lambda d=device: int(nvml.nvmlDeviceGetComputeInstanceId(d))),
                "uuid": _fact(lambda d=device: _text(nvml.nvmlDeviceGetUUID(d))),
                "memory_mib": _fact(lambda d=device: int(nvml.nvmlDeviceGetMemoryInfo(d).total) >> 20),
            }
        )
    return devices
