"""The GPU server's read-only replies (``poll``: what NVML would report; ``truth``: exact
figures) and the request checks they share with the server, over a node's engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def poll_reply(engines: Sequence[GpuEngine], request: dict[str, Any], now: float) -> dict[str, Any]:
    since = request.get("since") or {}
    if not isinstance(since, dict):
        raise RequestError("poll: since must map GPU indexes to µs timestamps")
    gpus = []
    for engine in engines:
        after = int(since.get(str(engine.index), 0))
        samples = [[s.pid, s.timestamp_us, s.sm_util] for s in engine.samples(after, now)]
        gpus.append(
            {
                "index": engine.index,
                "lost": engine.lost,
                "utilization": engine.device_utilization(now),
                "samples": samples,
                "memory": [[pid, used] for pid, used in engine.memory().items()],
            }
        )
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
            }
            for c in engine.truth(now)
        ]
        gpus.append(
            {"index": engine.index, "busy_s": engine.busy_s, "work_s": engine.work_s, "contexts": contexts}
        )
    return {"ok": True, "monotonic": now, "wall": now + wall_offset, "gpus": gpus}
