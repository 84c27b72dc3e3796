"""The ``nvml`` request: one of NVML's MIG functions, by its pynvml name, on the simulated
GPUs (``{"op": "nvml", "call": "nvmlDeviceCreateGpuInstance", "gpu": 0, "profile_id": 9}``).

A refused call replies ``{"ok": false, "error": ..., "nvml": code}`` with NVML's return code;
the client (:mod:`.migclient`) raises it as the NVML binding would. Structures come back
with pynvml's field names (``sliceCount``, ``memorySizeMB``...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agent.platform.gpu.migprofiles import ComputeInstanceProfile, GpuInstanceProfile, Placement
from agent.platform.gpu.nvmlcodes import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.mig import ComputeInstance, GpuInstance, MigError, MigGpu
from agent.platform.gpu.sim.migops import MigHost
from agent.platform.gpu.sim.replies import RequestError, gpu_field

Handler = Callable[[MigHost, MigGpu, dict[str, Any], float], dict[str, Any]]


def nvml_reply(
    host: MigHost, engines: Sequence[GpuEngine], request: dict[str, Any], now: float
) -> dict[str, Any]:
    """Answer one ``nvml`` request (``engines``: the node's, to check the GPU index)."""
    call = request.get("call")
    handler = _CALLS.get(call) if isinstance(call, str) else None
    if handler is None:
        raise RequestError(f"nvml: unknown or unsimulated call {call!r}; simulated: {sorted(_CALLS)}")
    mig = host.gpus[gpu_field(request, engines)]
    return {"ok": True, **handler(host, mig, request, now)}


def _int(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MigError(NVML_ERROR_INVALID_ARGUMENT, f"{request.get('call')}: {name} must be an integer")
    return value


def _placement(request: dict[str, Any]) -> Placement:
    raw = request.get("placement")
    if not (isinstance(raw, list) and len(raw) == 2 and all(type(v) is int for v in raw)):
        raise MigError(NVML_ERROR_INVALID_ARGUMENT, "placement must be [start, size]")
    return Placement(raw[0], raw[1])


def gi_profile_info(p: GpuInstanceProfile) -> dict[str, Any]:
    return {
        "id": p.id,
        "isP2pSupported": 0,
        "sliceCount": p.slices,
        "instanceCount": p.instance_count,
        "multiprocessorCount": p.sm_count,
        "copyEngineCount": p.copy_engines,
        "memorySizeMB": p.memory_mib,
        "name": p.nvml_name,
    }


def ci_profile_info(p: ComputeInstanceProfile) -> dict[str, Any]:
    return {
        "id": p.index,
        "sliceCount": p.slices,
        "instanceCount": p.instance_count,
        "multiprocessorCount": p.sm_count,
        "name": f"MIG {p.name}",
    }


def gi_info(mig: MigGpu, gi: GpuInstance) -> dict[str, Any]:
    return {
        "device": mig.index,
        "id": gi.id,
        "profileId": gi.profile.id,
        "placement": [gi.placement.start, gi.placement.size],
    }


def ci_info(mig: MigGpu, gi: GpuInstance, ci: ComputeInstance) -> dict[str, Any]:
    return {
        "device": mig.index,
        "gpuInstance": gi.id,
        "id": ci.id,
        "profileId": ci.profile.index,
        "placement": [ci.placement.start, ci.placement.size],
        "uuid": ci.uuid,
    }


def _mode(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    mig.require_capable()
    return {"current": int(mig.current), "pending": int(mig.pending)}


def _set_mode(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"activation": mig.set_mode(_int(r, "mode"), host.busy(mig.index))}


def _profile(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"info": gi_profile_info(mig.profile(_int(r, "profile")))}


def _placements(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"placements": [[p.start, p.size] for p in mig.placements(_int(r, "profile_id"))]}


def _remaining(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"count": mig.remaining(_int(r, "profile_id"))}


def _create_gi(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    placement = _placement(r) if r.get("call") == "nvmlDeviceCreateGpuInstanceWithPlacement" else None
    return {"gi": gi_info(mig, mig.create_gi(_int(r, "profile_id"), placement))}


def _gis(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    mig.require_enabled()
    profile = mig.profile_by_id(_int(r, "profile_id"))
    found = [gi for _, gi in sorted(mig.gis.items()) if gi.profile.id == profile.id]
    return {"gis": [gi_info(mig, gi) for gi in found]}


def _gi(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"gi": gi_info(mig, mig.gi(_int(r, "gi")))}


def _destroy_gi(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    mig.destroy_gi(_int(r, "gi"))
    return {}


def _ci_profile(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    if r.get("eng_profile", 0) != 0:
        raise MigError(NVML_ERROR_INVALID_ARGUMENT, "only NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED (0)")
    return {"info": ci_profile_info(mig.ci_profile(_int(r, "gi"), _int(r, "profile")))}


def _ci_remaining(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"count": mig.ci_remaining(_int(r, "gi"), _int(r, "profile_id"))}


def _create_ci(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    with_placement = r.get("call") == "nvmlGpuInstanceCreateComputeInstanceWithPlacement"
    gi_id = _int(r, "gi")
    ci = host.add_ci(mig.index, gi_id, _int(r, "profile_id"), now, _placement(r) if with_placement else None)
    return {"ci": ci_info(mig, mig.gi(gi_id), ci)}


def _cis(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    gi = mig.gi(_int(r, "gi"))
    profile = mig.ci_profile(gi.id, _int(r, "profile_id"))
    found = [ci for _, ci in sorted(gi.cis.items()) if ci.profile.index == profile.index]
    return {"cis": [ci_info(mig, gi, ci) for ci in found]}


def _ci(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    gi = mig.gi(_int(r, "gi"))
    return {"ci": ci_info(mig, gi, mig.ci(gi.id, _int(r, "ci")))}


def _destroy_ci(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    host.destroy_ci(mig.index, _int(r, "gi"), _int(r, "ci"))
    return {}


def _max_devices(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"count": 7 if mig.product is not None and mig.current else 0}


def _device_by_index(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    mig.require_enabled()
    index = _int(r, "index")
    if not 0 <= index < 7:
        raise MigError(NVML_ERROR_INVALID_ARGUMENT, f"MIG device index {index} is not in 0..6")
    devices = mig.device_list()
    if index >= len(devices):
        raise MigError(NVML_ERROR_NOT_FOUND, f"GPU {mig.index} has no MIG device {index}")
    gi, ci = devices[index]
    return {"device": _device_fields(mig, gi, ci, index)}


def _device_fields(mig: MigGpu, gi: GpuInstance, ci: ComputeInstance, index: int) -> dict[str, Any]:
    d = mig.device(gi, ci, index)
    return {"gpu": d.gpu_index, "index": index, "gi": d.gi, "ci": d.ci, "uuid": d.uuid,
            "memory_mib": d.memory_mib, "sm_count": d.sm_count, "name": f"MIG {d.profile}"}  # fmt: skip


def _memory(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    dev = host.device(str(r.get("uuid")))
    used = sum(dev.engine.memory().values())
    total = dev.engine.config.memory_bytes
    return {"total": total, "used": used, "free": total - used}


def _utilization(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    uuid = r.get("uuid")
    host.utilization_refused(mig.index, None if uuid is None else str(uuid))
    return {"gpu": host.physical(mig.index).device_utilization(now), "memory": 0}


def _process_utilization(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    uuid = r.get("uuid")
    host.utilization_refused(mig.index, None if uuid is None else str(uuid))
    raise RequestError("nvmlDeviceGetProcessUtilization of a GPU out of MIG mode: read it with poll")


def _gpm(host: MigHost, mig: MigGpu, r: dict[str, Any], now: float) -> dict[str, Any]:
    return {"sample": host.gpm_sample(mig.index, _int(r, "gi"), now)}


_CALLS: dict[str, Handler] = {
    "nvmlDeviceGetMigMode": _mode,
    "nvmlDeviceSetMigMode": _set_mode,
    "nvmlDeviceGetGpuInstanceProfileInfo": _profile,
    "nvmlDeviceGetGpuInstancePossiblePlacements": _placements,
    "nvmlDeviceGetGpuInstanceRemainingCapacity": _remaining,
    "nvmlDeviceCreateGpuInstance": _create_gi,
    "nvmlDeviceCreateGpuInstanceWithPlacement": _create_gi,
    "nvmlDeviceGetGpuInstances": _gis,
    "nvmlDeviceGetGpuInstanceById": _gi,
    "nvmlGpuInstanceDestroy": _destroy_gi,
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": _ci_profile,
    "nvmlGpuInstanceGetComputeInstanceRemainingCapacity": _ci_remaining,
    "nvmlGpuInstanceCreateComputeInstance": _create_ci,
    "nvmlGpuInstanceCreateComputeInstanceWithPlacement": _create_ci,
    "nvmlGpuInstanceGetComputeInstances": _cis,
    "nvmlGpuInstanceGetComputeInstanceById": _ci,
    "nvmlComputeInstanceDestroy": _destroy_ci,
    "nvmlDeviceGetMaxMigDeviceCount": _max_devices,
    "nvmlDeviceGetMigDeviceHandleByIndex": _device_by_index,
    "nvmlDeviceGetMemoryInfo": _memory,
    "nvmlDeviceGetUtilizationRates": _utilization,
    "nvmlDeviceGetProcessUtilization": _process_utilization,
    "nvmlGpmMigSampleGet": _gpm,
}
