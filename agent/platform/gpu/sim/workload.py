"""A simulated CUDA workload as a real process: it runs a pattern (:mod:`.programs`) against
the GPU server through its own context, and (optionally) makes the NVIDIA driver calls the
ioctl tracer attributes (:mod:`.driver`: RM_ALLOC for its memory, one RM_CONTROL per sync).

It is what the cgroup freezer and signals act on: frozen, it submits nothing, while the work
it already queued keeps running on the GPU. It uses little CPU itself: a launch or a sync is
one request to the server, and it sleeps through every blocking call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import InvalidSpecError, PlatformError, SimulationError
from agent.platform.atomicfile import write_atomic
from agent.platform.gpu.mpspartition import parse_percentage
from agent.platform.gpu.sim.client import ContextClient
from agent.platform.gpu.sim.driver import SimDriverCalls
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.gpu.sim.programs import (
    Alloc,
    GraphLaunch,
    Launch,
    Op,
    PatternSpec,
    Sleep,
    Sync,
    WorkloadStats,
    pattern_program,
    with_memory,
)

log = logging.getLogger(__name__)

MPS_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
_UNITS = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}


@dataclass(frozen=True)
class WorkloadSpec:
    gpu: int
    mig: str | None = None  # the UUID of the GPU's MIG device to run on
    pattern: PatternSpec = field(default_factory=PatternSpec)
    memory_mib: int = 0
    duration_s: float | None = None  # None: until stopped
    grow_to_mib: int | None = None  # after grow_after_s, hold this much memory instead
    grow_after_s: float = 0.0
    grow_step_mib: int = 0  # grow by this much every grow_every_s (0: all at once)
    grow_every_s: float = 0.0
    driver_ioctls: bool = False  # make NVIDIA-shaped ioctls for the tracer (driver.py)
    progress: Path | None = None  # append each step's completion wall time here (--progress)
    latency_after_s: float = 0.0  # latency percentiles over requests answered after this long

    def validate(self) -> None:
        problems = self.pattern.problems()
        if self.memory_mib < 0:
            problems.append(f"--memory-mib must be >= 0, got {self.memory_mib}")
        if self.duration_s is not None and self.duration_s <= 0:
            problems.append(f"--duration must be > 0, got {self.duration_s}")
        if self.grow_to_mib is not None and self.grow_to_mib < 0:
            problems.append(f"--grow-to-mib must be >= 0, got {self.grow_to_mib}")
        if self.latency_after_s < 0:
            problems.append(f"--latency-after must be >= 0, got {self.latency_after_s}")
        if self.grow_after_s < 0:
            problems.append(f"--grow-after must be >= 0, got {self.grow_after_s}")
        if self.grow_step_mib < 0 or self.grow_every_s < 0:
            problems.append("--grow-step-mib and --grow-every must be >= 0")
        if self.grow_step_mib > 0 and (self.grow_to_mib is None or self.grow_to_mib <= self.memory_mib):
            problems.append("--grow-step-mib needs --grow-to-mib above --memory-mib")
        if problems:
            raise InvalidSpecError("; ".join(problems))


def mps_share(environ: dict[str, str] | None = None) -> float:
    """The MPS active-thread percentage from the environment, as a CUDA client reads it at
    start (100 when unset)."""
    raw = (os.environ if environ is None else environ).get(MPS_PERCENT_ENV, "").strip()
    if not raw:
        return 100.0
    try:
        return parse_percentage(raw)
    except ValueError as err:
        raise InvalidSpecError(f"{MPS_PERCENT_ENV}: {err}") from err


def mps_memory_limit_mib(environ: dict[str, str] | None = None) -> int | None:
    """The pinned device-memory limit of the first visible device (index 0: the one GPU
    the container sees) from ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` ("0=2048M,1=1G"), in MiB;
    None when unset or not given for device 0."""
    raw = (os.environ if environ is None else environ).get(MPS_MEMORY_ENV, "").strip()
    if not raw:
        return None
    for item in raw.split(","):
        device, sep, value = item.strip().partition("=")
        if not sep:
            raise InvalidSpecError(f"{MPS_MEMORY_ENV}={raw!r}: expected DEVICE=LIMIT items like 0=2048M")
        if device.strip() != "0":
            continue
        text = value.strip().upper().removesuffix("B")
        number, unit = (text[:-1], text[-1]) if text[-1:] in "KMGT" and text[-1:] else (text, "")
        if not number.isdigit():
            raise InvalidSpecError(f"{MPS_MEMORY_ENV}={raw!r}: {value!r} is not a size like 2048M or 2G")
        return int(int(number) * _UNITS[unit])
    return None


def mig_from_environment(environ: dict[str, str] | None = None) -> str | None:
    """The MIG device ``CUDA_VISIBLE_DEVICES`` names first (``MIG-<uuid>``), as CUDA picks
    it; None when it names none."""
    raw = (os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV, "")
    first = raw.split(",")[0].strip()
    return first if first.startswith("MIG-") else None


def run_workload(state_dir: Path, spec: WorkloadSpec, stop: threading.Event) -> WorkloadStats:
    """Open a context on the spec's GPU and run its pattern until ``stop`` or the duration
    ends; the context (and whatever it still had queued) goes with the connection."""
    spec.validate()
    root = SimNodeDir(state_dir)
    root.read_node().gpu(spec.gpu)  # a clear error for a node or GPU that is not there
    stats = WorkloadStats(started_at=time.monotonic())
    ctx = ContextClient(
        root.socket,
        spec.gpu,
        mps_share(),
        mps_pipe=os.environ.get(MPS_PIPE_ENV, ""),
        memory_limit_mib=mps_memory_limit_mib(),
        mig=spec.mig or "",
    )
    ctx.interrupted = stop.is_set
    driver = SimDriverCalls() if spec.driver_ioctls else None
    end = None if spec.duration_s is None else time.monotonic() + spec.duration_s
    program = with_memory(
        pattern_program(spec.pattern, stats),
        spec.memory_mib,
        spec.grow_to_mib,
        spec.grow_after_s,
        grow_step_mib=spec.grow_step_mib,
        grow_every_s=spec.grow_every_s,
    )
    progress = None if spec.progress is None else Progress(spec.progress, _step_op(spec.pattern))
    try:
        op = next(program)
        while not stop.is_set() and (end is None or time.monotonic() < end):
            _execute(op, ctx, driver, stop, end)
            if progress is not None:
                progress.done(op)
            op = program.send(time.monotonic())
    except InterruptedError:
        pass  # stopped while a call waited on the GPU
    finally:
        ctx.close()
        if driver is not None:
            driver.close()
        if progress is not None:
            progress.close()
    return stats


def _step_op(pattern: PatternSpec) -> type[Op]:
    """What completes a step: a sync returning; in a pattern that never syncs (burn by
    default), a batch of launches queued (with the queue full, as many have completed)."""
    return Launch if pattern.pattern == "burn" and not pattern.syncs_every else Sync


class Progress:
    """``--progress``: the wall time of each step's completion appended to a file, one per
    line, in batches at least every 0.2 s (bench/gpu_suite.py reads the workload's throughput
    from it, as it reads a PyTorch worker's)."""

    FLUSH_S = 0.1

    def __init__(self, path: Path, step: type[Op]) -> None:
        self._file = path.open("a")
        self._step = step
        self._batch: list[float] = []
        self._flushed = time.monotonic()

    def done(self, op: Op) -> None:
        if isinstance(op, self._step):
            self._batch.append(time.time())
        if self._batch and time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._file.write("".join(f"{t:.6f}\n" for t in self._batch))
        self._file.flush()
        self._batch.clear()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


def _execute(
    op: Op, ctx: ContextClient, driver: SimDriverCalls | None, stop: threading.Event, end: float | None
) -> None:
    if isinstance(op, Launch):
        ctx.launch(op.count, op.kernel_s)
    elif isinstance(op, GraphLaunch):
        ctx.graph(op.kernels, op.kernel_s)
    elif isinstance(op, Sync):
        ctx.sync()
        if driver is not None:
            driver.control()  # a CUDA process's bookkeeping with the driver
    elif isinstance(op, Sleep):
        seconds = op.seconds if end is None else min(op.seconds, max(0.0, end - time.monotonic()))
        stop.wait(seconds)
    else:
        assert isinstance(op, Alloc)
        ctx.alloc(op.mib)
        if driver is not None:
            driver.allocate(op.mib)


def report(spec: WorkloadSpec, stats: WorkloadStats) -> dict[str, Any]:
    """What the workload did, as ``--report`` writes it."""
    since = None if stats.started_at is None else stats.started_at + spec.latency_after_s
    p50, p99 = stats.latency(0.5, since), stats.latency(0.99, since)
    return {
        "pid": os.getpid(),
        "pattern": spec.pattern.pattern,
        "launches": stats.launches,
        "syncs": stats.syncs,
        "requests": stats.requests,
        "latency_p50_ms": None if p50 is None else round(p50 * 1000, 3),
        "latency_p99_ms": None if p99 is None else round(p99 * 1000, 3),
        "phases": stats.phases,
    }


def write_report(path: Path, content: dict[str, Any]) -> None:
    try:
        write_atomic(path, json.dumps(content).encode())
    except PlatformError as err:
        raise SimulationError(f"cannot write the workload report {path}: {err.__cause__ or err}") from err
