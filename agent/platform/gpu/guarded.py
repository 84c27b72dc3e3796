"""Per-GPU backend calls with a deadline, so that a driver stuck in one call cannot stall the agent.

An NVML call can hang for seconds (a GPU in trouble, a driver waiting on its firmware):
the calling thread sits in an ioctl and nothing interrupts it. ``GuardedBackend`` wraps a
backend so that each GPU's per-GPU calls (process samples, utilization, process memory,
sample period, memory limits, MIG state) run on that GPU's own worker thread, one at a time:

- a caller waits for its call up to ``deadline_s``, then gets ``GpuHungError`` and moves
  on; the call goes on in the worker;
- a call that has run longer than the deadline makes its GPU *degraded*, with a reason
  naming the NVML function; while it is, new calls on that GPU fail at once (nothing
  queues behind a stuck call), and calls on the other GPUs are not affected;
- when the stuck call returns, the GPU recovers (logged, with how long the call took).

So a hang, however long, holds one thread per GPU (its worker) and no caller for longer
than the deadline. Callers that must not wait at all (the control loop) ``submit_*`` and
collect the result when it is there. Inventory, topology, health events and shutdown go
straight to the wrapped backend.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from agent.errors import GpuError, GpuHungError, NoSuchGpuError
from agent.platform.gpu.inventory import (
    CALL_DEVICE_SAMPLES,
    CALL_DEVICE_UTILIZATION,
    CALL_MIG,
    CALL_PROCESS_MEMORY,
    CALL_PROCESS_SAMPLES,
    CALL_SAMPLE_PERIOD,
    CALL_SET_MEMORY_LIMIT,
    DeviceEvent,
    DeviceSample,
    GpuBackend,
    GpuInfo,
    ProcessMemory,
    ProcessSample,
    Topology,
)
from agent.platform.gpu.migcontrol import MigControl
from agent.platform.gpu.migstate import MigInfo
from agent.platform.threadname import set_native_name

log = logging.getLogger(__name__)

T = TypeVar("T")

DEADLINE_S = 2.0
MAX_QUEUED = 8  # per GPU: a few agent threads call; more waiting means they are not waiting any more


class PendingCall(Generic[T]):
    """A call handed to a GPU's worker; ``result()`` once ``done()``."""

    def __init__(self, index: int, call: str) -> None:
        self.index = index
        self.call = call
        self._done = threading.Event()
        self._value: Any = None
        self._error: Exception | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(max(0.0, timeout_s))

    def result(self) -> T:
        """The call's value, or its exception raised here (in the caller's thread)."""
        if not self._done.is_set():
            raise GpuError(f"GPU {self.index}: {self.call} has not returned yet")
        if self._error is not None:
            raise self._error
        return cast(T, self._value)

    def finish(self, value: Any, error: Exception | None) -> None:
        self._value, self._error = value, error
        self._done.set()


_Job = tuple[Callable[[], Any], PendingCall[Any]]


class _GpuWorker:
    """One GPU's calls, one at a time, on one thread (started at the first call)."""

    def __init__(self, index: int, deadline_s: float) -> None:
        self.index = index
        self._deadline_s = deadline_s
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: PendingCall[Any] | None = None
        self._started_at = 0.0
        self._announced = False  # the running call's hang was logged and counted
        self._thread: threading.Thread | None = None
        self._closed = False
        self.timeouts: collections.Counter[str] = collections.Counter()  # calls past the deadline

    def submit(self, call: str, fn: Callable[[], T]) -> PendingCall[T]:
        pending: PendingCall[T] = PendingCall(self.index, call)
        with self._cond:
            if self._closed:
                raise GpuError(f"GPU {self.index}: the GPU backend is closed")
            stuck = self._stuck()
            if stuck is not None:
                assert self._running is not None
                raise GpuHungError(self.index, self._running.call, stuck)
            if len(self._queue) >= MAX_QUEUED:
                raise GpuHungError(self.index, call, f"{MAX_QUEUED} calls are already waiting for the GPU")
            self._queue.append((fn, pending))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"gpu-calls-{self.index}", daemon=True)
                self._thread.start()
            self._cond.notify()
        return pending

    def cancel(self, pending: PendingCall[Any]) -> None:
        """Drop ``pending`` if it has not started (its caller stopped waiting)."""
        with self._cond:
            for job in self._queue:
                if job[1] is pending:
                    self._queue.remove(job)
                    return

    def degraded(self) -> str | None:
        with self._cond:
            return self._stuck()

    def overdue(self, pending: PendingCall[Any]) -> str | None:
        """Why the GPU is degraded after ``pending``'s caller waited the whole deadline.

        The caller's clock starts at submission, the worker's when it picks the call up
        (later on a busy host: thread start, scheduling); the caller's wait is the
        evidence, so a running ``pending`` counts as past the deadline from here on."""
        with self._cond:
            if self._running is pending:
                self._started_at = min(self._started_at, time.monotonic() - self._deadline_s)
            return self._stuck()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for _, pending in queued:
            pending.finish(None, GpuError(f"GPU {self.index}: the GPU backend is closed"))

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _stuck(self) -> str | None:
        """Why the GPU is degraded (its running call is past the deadline), else None; with
        ``_cond`` held. The first to notice logs and counts it."""
        if self._running is None:
            return None
        elapsed = time.monotonic() - self._started_at
        if elapsed < self._deadline_s:
            return None
        call = self._running.call
        if not self._announced:
            self._announced = True
            self.timeouts[call] += 1
            log.warning(
                "GPU %d degraded: %s has not returned for %.1f s (deadline %g s); its other calls "
                "fail at once until it returns",
                self.index,
                call,
                elapsed,
                self._deadline_s,
            )
        return f"{call} did not return within {self._deadline_s:g} s"

    def _run(self) -> None:
        set_native_name(threading.current_thread().name)  # per-thread CPU tells the GPUs' calls apart
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return  # closed
                fn, pending = self._queue.popleft()
                self._running, self._started_at, self._announced = pending, time.monotonic(), False
            value: Any = None
            error: Exception | None = None
            try:
                value = fn()
            except Exception as err:  # noqa: BLE001  (not swallowed: handed to the caller, raised there)
                error = err
            with self._cond:
                elapsed = time.monotonic() - self._started_at
                if elapsed >= self._deadline_s:
                    if not self._announced:  # stuck while nobody asked: still a timeout
                        self.timeouts[pending.call] += 1
                    log.warning(
                        "GPU %d recovered: %s returned after %.1f s", self.index, pending.call, elapsed
                    )
                self._running = None
            pending.finish(value, error)


class GuardedBackend:
    """``backend`` with per-GPU calls under a deadline (see the module docstring)."""

    def __init__(self, backend: GpuBackend, deadline_s: float = DEADLINE_S) -> None:
        self.inner = backend
        self.deadline_s = deadline_s
        self._workers = {g.index: _GpuWorker(g.index, deadline_s) for g in backend.gpus()}

    # Straight through ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.inner.name

    def gpus(self) -> Sequence[GpuInfo]:
        return self.inner.gpus()

    def topology(self) -> Topology:
        return self.inner.topology()

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        return self.inner.wait_events(timeout_s)

    def mps_control_command(self) -> list[str]:
        return self.inner.mps_control_command()

    def memory_limits_support(self) -> str | None:
        return self.inner.memory_limits_support()

    # Per-GPU calls, waited for up to the deadline ------------------------------------------------
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        return self._call(self.submit_process_samples(index, since_us))

    def device_utilization(self, index: int) -> int:
        return self._call(self.submit_device_utilization(index))

    def sample_period_s(self, index: int) -> float | None:
        return self._call(self.submit_sample_period(index))

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        return self._call(self.submit_device_samples(index, since_us))

    def process_memory(self, index: int) -> list[ProcessMemory]:
        inner = self.inner
        return self._call(
            self._worker(index).submit(CALL_PROCESS_MEMORY, lambda: inner.process_memory(index))
        )

    def mig(self, index: int) -> MigInfo:
        inner = self.inner
        return self._call(self._worker(index).submit(CALL_MIG, lambda: inner.mig(index)))

    def mig_control(self) -> MigControl:
        """Straight through: MIG changes are rare, made by one loop that waits for them."""
        return self.inner.mig_control()

    def set_memory_limit(self, index: int, cgroup: Path, limit_bytes: int | None) -> None:
        inner = self.inner
        self._call(
            self._worker(index).submit(
                CALL_SET_MEMORY_LIMIT, lambda: inner.set_memory_limit(index, cgroup, limit_bytes)
            )
        )

    # Per-GPU calls, not waited for (the control loop collects them) ------------------------------
    def submit_process_samples(self, index: int, since_us: int) -> PendingCall[list[ProcessSample]]:
        inner = self.inner
        return self._worker(index).submit(
            CALL_PROCESS_SAMPLES, lambda: inner.process_samples(index, since_us)
        )

    def submit_device_utilization(self, index: int) -> PendingCall[int]:
        inner = self.inner
        return self._worker(index).submit(CALL_DEVICE_UTILIZATION, lambda: inner.device_utilization(index))

    def submit_device_samples(self, index: int, since_us: int) -> PendingCall[list[DeviceSample]]:
        inner = self.inner
        return self._worker(index).submit(CALL_DEVICE_SAMPLES, lambda: inner.device_samples(index, since_us))

    def submit_sample_period(self, index: int) -> PendingCall[float | None]:
        inner = self.inner
        return self._worker(index).submit(CALL_SAMPLE_PERIOD, lambda: inner.sample_period_s(index))

    # State -------------------------------------------------------------------------------------
    def degraded(self, index: int) -> str | None:
        """Why the GPU is degraded now (a call stuck past the deadline), else None."""
        worker = self._workers.get(index)
        return None if worker is None else worker.degraded()

    def call_timeouts(self) -> dict[tuple[int, str], int]:
        """{(GPU index, NVML function): calls that ran past the deadline since the start}."""
        return {(i, call): n for i, w in self._workers.items() for call, n in w.timeouts.items()}

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self.inner.close()  # a stuck call may still be inside: the process is ending anyway
        for worker in self._workers.values():
            worker.join(timeout_s=1.0)

    def _worker(self, index: int) -> _GpuWorker:
        worker = self._workers.get(index)
        if worker is None:
            raise NoSuchGpuError(f"no GPU with index {index}; this node has {len(self._workers)}")
        return worker

    def _call(self, pending: PendingCall[T]) -> T:
        if not pending.wait(self.deadline_s):
            worker = self._workers[pending.index]
            worker.cancel(pending)
            reason = worker.overdue(pending) or f"{pending.call} did not return within {self.deadline_s:g} s"
            raise GpuHungError(pending.index, pending.call, reason)
        return pending.result()
