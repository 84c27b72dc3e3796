"""The GPU server's read-only replies (``poll``: what NVML would report; ``truth``: exact
figures) and the request checks they share with the server, over a node's engines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.platform.gpu.inventory import PER_GPU_CALLS
from agent.platform.gpu.sim.engine import GpuEngine


class RequestError(Exception):
    """A request the server refuses; its text goes back to the client."""


def int_field(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{request.get('op')}: {name} must be an integer, got {value!r}")
    return value


def gpu_field(request: dict[str, Any], engines: Sequence[GpuEngine]) -> int:
    gpu = int_field(request, "gpu")
    if not 0 <= gpu < len(engines):
        raise RequestError(f"no GPU {gpu}: the simulated node has GPUs 0..{len(engines) - 1}")
    return gpu


def hang_request(
    request: dict[str, Any], engines: Sequence[GpuEngine], now: float
) -> tuple[int, tuple[str, float]]:
    """A ``hang`` request checked: (GPU, (its NVML call or ``*``, monotonic end)). Fault
    injection: the agent's backend then blocks in that call, as a driver stuck in an ioctl."""
    gpu = gpu_field(request, engines)
    call = request.get("call")
    if call != "*" and call not in PER_GPU_CALLS:
        raise RequestError(f"hang: call must be * or one of {list(PER_GPU_CALLS)}, got {call!r}")
    seconds = request.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 3600:
        raise RequestError(f"hang: seconds must be 0..3600, got {seconds!r}")
    return gpu, (str(call), now + float(seconds))


def poll_reply(
    engines: Sequence[GpuEngine],
    request: dict[str, Any],
    now: float,
    hangs: Mapping[int, tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """The driver's samples newer than ``since`` (per-process) and ``device_since`` (device
    utilization), per GPU: NVML's aggregation of the per-process ones runs in the reader, as
    the NVML library does. ``hangs``: GPU -> (NVML call, monotonic end) of injected hangs; an
    active one is sent as ``hang: [call, seconds left]``."""
    since, device_since = request.get("since") or {}, request.get("device_since") or {}
    if not isinstance(since, dict) or not isinstance(device_since, dict):
        raise RequestError("poll: since and device_since must map GPU indexes to µs timestamps")
    gpus = []
    for engine in engines:
        after = int(since.get(str(engine.index), 0))
        device_after = int(device_since.get(str(engine.index), 0))
        driver = [[s.pid, s.timestamp_us, s.sm_util] for s in engine.driver_samples(after, now)]
        device = [[s.timestamp_us, s.util] for s in engine.device_samples(device_after, now)]
        gpu: dict[str, Any] = {
            "index": engine.index,
            "lost": engine.lost,
            "utilization": engine.device_utilization(now),
            "driver": driver,
            "device": device,
            "memory": [[pid, used] for pid, used in engine.memory().items()],
        }
        hang = (hangs or {}).get(engine.index)
        if hang is not None and hang[1] > now:
            gpu["hang"] = [hang[0], hang[1] - now]
        gpus.append(gpu)
    return {"ok": True, "gpus": gpus}


def truth_reply(engines: Sequence[GpuEngine], now: float, wall_offset: float) -> dict[str, Any]:
    gpus = []
    for engine in engines:
        contexts = [
            {
                "pid": c.pid,
                "start_ticks": c.start_ticks,
                "ran_s": c.ran_s,
                "queued": c.queued,
                "pending_s": c.pending_s,
                "memory_bytes": c.memory_bytes,
                "peak_memory_bytes": c.peak_memory_bytes,
            }
            for c in engine.truth(now)
        ]
        departed = [
            {"pid": pid, "start_ticks": ticks, "peak_memory_bytes": peak}
            for pid, ticks, peak in engine.departed_peaks
        ]
        gpus.append(
            {
                "index": engine.index,
                "busy_s": engine.busy_s,
                "work_s": engine.work_s,
                "contexts": contexts,
                "departed": departed,
            }
        )
    return {"ok": True, "monotonic": now, "wall": now + wall_offset, "gpus": gpus}
