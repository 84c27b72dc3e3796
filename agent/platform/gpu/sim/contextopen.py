"""The ``open`` request: a process's context on one GPU, with what it may use there (its
MPS limits when the GPU's control daemon serves it: :mod:`.mpscontrol`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import PlatformError
from agent.platform.gpu.mpspartition import curve_throughput, effective_share
from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.driverstate import DriverState
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.replies import RequestError, gpu_field
from agent.platform.procfs import ProcFS

MIB = 1 << 20


@dataclass(frozen=True)
class OpenRequest:
    gpu: int
    percent: float  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE as the client read it (100 unset)
    memory_limit: int | None  # bytes: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for device 0
    mps_pipe: str  # CUDA_MPS_PIPE_DIRECTORY ("" unset)


def parse_open(request: dict[str, Any], engines: Sequence[GpuEngine]) -> OpenRequest:
    gpu = gpu_field(request, engines)
    if engines[gpu].lost:
        raise RequestError(f"GPU {gpu} is lost (fell off the bus)")
    try:
        share = float(request.get("share", 100))
    except (TypeError, ValueError) as err:
        raise RequestError(f"share must be a number, got {request.get('share')!r}") from err
    if not 0 < share <= 100:
        raise RequestError(f"share must be 1..100 percent, got {share}")
    limit_mib = request.get("memory_limit_mib")
    if limit_mib is not None and (
        isinstance(limit_mib, bool) or not isinstance(limit_mib, int) or limit_mib < 0
    ):
        raise RequestError(f"memory_limit_mib must be a non-negative integer, got {limit_mib!r}")
    memory = None if limit_mib is None else limit_mib * MIB
    return OpenRequest(gpu, share, memory, str(request.get("mps_pipe") or ""))


def open_context(
    engine: GpuEngine,
    driver: DriverState,
    procfs: ProcFS,
    req: OpenRequest,
    *,
    pid: int,
    uid: int,
    now: float,
) -> Context | None:
    """The process's new context; None while it must wait (an MPS client of another user id
    than the running server's, which still has clients)."""
    client = driver.mps_client(req.gpu, req.mps_pipe)
    try:
        start_ticks = procfs.identity(pid).start_ticks
    except PlatformError as err:
        raise RequestError(f"cannot identify the client process {pid}: {err}") from err
    percent, memory = req.percent, req.memory_limit
    if client:  # the daemon's limits; the client's own environment only lowers them
        limits = driver.mps_admit(req.gpu, pid, uid, percent, memory)
        if limits is None:
            return None
        percent, memory = limits.percentage, limits.pinned_bytes
    return engine.create_context(
        pid,
        start_ticks,
        now,
        # Without an MPS server the variable does nothing; with one, whole TPCs of SMs, or
        # the throughput the product was recorded giving at that percentage.
        share=mps_share(percent, engine.config) if engine.mps else 1.0,
        mps_client=client,
        memory_limit=memory if engine.mps else None,
        cgroup=driver.cgroup_of(pid),
    )


def mps_share(percent: float, config: EngineConfig) -> float:
    """The fraction of the GPU an MPS client at ``percent`` runs at."""
    if config.mps_curve is not None:
        return curve_throughput(percent, config.mps_curve)
    return effective_share(percent, config.sm_count)


def open_reply(ctx: Context, mps: bool) -> dict[str, Any]:
    limit = ctx.memory_limit
    return {
        "ok": True,
        "context": ctx.cid,
        "pid": ctx.pid,
        "mps": mps,
        "share": ctx.share,  # the fraction of the GPU's SMs it may use
        "memory_limit_mib": None if limit is None else limit // MIB,
    }
