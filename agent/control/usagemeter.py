"""Measuring each GPU container's use for the compute-cap loop.

Each control period the meter reads every GPU's new per-process samples and device
utilization, maps pids to containers and feeds one estimator per GPU
(:mod:`agent.domain.usage`). A container is then measured over whole duty cycles of its
own: from one of its cycle starts to a later one, the span at least the measurement window
and ending at the newest sample, so a long cycle's thawed and frozen parts are both counted
in full whatever the phase of the samples. Without enough history yet (a fresh start, a
cycle just lengthened) it is measured over the plain window ending at the newest sample.

Against a backend that runs each GPU's calls on a worker of its own (``GuardedBackend``),
the reads are not waited for beyond ``read_wait_s``: a GPU whose call hangs delays neither
the other GPUs nor the period; its results are taken in whenever they come. A GPU with no
successful read for ``stale_after_s`` is *stale*: the controller then holds none of its
containers (it would act on figures it does not have), until readings come back.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from agent.clock import Clock
from agent.domain.dutycontrol import CLOCK_TOL_S, Gains, Measurement
from agent.domain.usage import Estimate, GpuUsageEstimator
from agent.errors import VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.guarded import DEADLINE_S
from agent.platform.gpu.inventory import DeviceSample, ProcessSample

log = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)
STALE_AFTER_S = DEADLINE_S  # as long as a backend call may take before its GPU is degraded


class SampleSource(Protocol):
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]: ...

    def device_utilization(self, index: int) -> int: ...

    def sample_period_s(self, index: int) -> float | None: ...

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]: ...


class Pending(Protocol[T_co]):
    def wait(self, timeout_s: float) -> bool: ...

    def result(self) -> T_co: ...


A = TypeVar("A")
B = TypeVar("B")


def collect_done(
    in_flight: dict[int, tuple[Pending[A], Pending[B]]], until: float, clock: Clock
) -> list[tuple[int, tuple[A, B] | VcudaError]]:
    """The GPUs whose two reads are both done by ``until`` (monotonic), taken out of
    ``in_flight`` with their results or the error one raised; the rest stay in flight."""
    done: list[tuple[int, tuple[A, B] | VcudaError]] = []
    for gpu, (first, second) in list(in_flight.items()):
        if not first.wait(until - clock.monotonic()) or not second.wait(until - clock.monotonic()):
            continue
        del in_flight[gpu]
        try:
            done.append((gpu, (first.result(), second.result())))
        except VcudaError as err:
            done.append((gpu, err))
    return done


@runtime_checkable
class SubmittingSource(SampleSource, Protocol):
    """A source whose reads run on per-GPU workers: submitted now, collected when done."""

    def submit_process_samples(self, index: int, since_us: int) -> Pending[list[ProcessSample]]: ...

    def submit_device_utilization(self, index: int) -> Pending[int]: ...

    def submit_sample_period(self, index: int) -> Pending[float | None]: ...

    def submit_device_samples(self, index: int, since_us: int) -> Pending[list[DeviceSample]]: ...

    def degraded(self, index: int) -> str | None: ...


def container_key(pod_uid: str, container_id: str) -> str:
    """The loop's key for a container: a string, whose hash Python caches (a dataclass's
    is recomputed on every lookup, and the loop does thousands per period)."""
    return f"{pod_uid}/{container_id}"


class UsageMeter:
    """Samples in, per-container measurements out (one control loop's, not thread-safe)."""

    def __init__(
        self,
        gpus: Sequence[int],
        samples: SampleSource,
        owner_of: Callable[[int], ContainerRef | None],
        *,
        gains: Gains,
        clock: Clock,
        report: Callable[[int, str], None],
        read_wait_s: float | None = None,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``read_wait_s``: how long a period waits for submitted reads (default: 40 % of
        the control period)."""
        self._samples = samples
        self._submitting = samples if isinstance(samples, SubmittingSource) else None
        self._read_wait_s = 0.4 * gains.period_s if read_wait_s is None else read_wait_s
        self._stale_after_s = stale_after_s
        self._in_flight: dict[int, tuple[Pending[list[ProcessSample]], Pending[int]]] = {}
        self._period_pending: dict[int, Pending[float | None]] = {}
        self._fresh_at = dict.fromkeys(gpus, clock.monotonic())  # last successful read
        self._last_error: dict[int, str] = {}
        self._owner_of = owner_of
        self._gains = gains
        self._clock = clock
        self._report = report
        keep = gains.window_for(gains.max_cycles) + gains.max_cycles * gains.period_s
        self.estimators = {g: GpuUsageEstimator[str](gains.window_s, keep_s=keep) for g in gpus}
        self._since = dict.fromkeys(gpus, 0)
        self._period_asked: set[int] = set()
        # (period index, wall time of its start): the cycle starts containers are measured by.
        periods_kept = int(2 * keep / gains.period_s) + 4
        self._starts: collections.deque[tuple[int, float]] = collections.deque(maxlen=periods_kept)
        self._estimates: dict[int, Estimate[str]] = {}
        self._spans: dict[tuple[int, float, float], dict[str, float]] = {}
        self.errors = 0

    def period_started(self, index: int, monotonic_start: float) -> float:
        """Record period ``index``'s start; returns it in wall time (measurements taken this
        period are stamped with it, so a cycle starting now counts as after them)."""
        wall = self._clock.wall() - (self._clock.monotonic() - monotonic_start)
        self._starts.append((index, wall))
        return wall

    def read(self, gpus: Sequence[int] | None = None) -> None:
        """Take in the new samples and the device utilization of ``gpus`` (default all)."""
        owners: dict[int, str | None] = {}
        now = self._clock.monotonic()
        wanted = list(self.estimators) if gpus is None else [g for g in gpus if g in self.estimators]
        if self._submitting is not None:
            self._read_submitted(now, owners, wanted)
        else:
            for gpu in wanted:
                try:
                    samples = self._samples.process_samples(gpu, self._since[gpu])
                    device = self._samples.device_utilization(gpu)
                except VcudaError as err:
                    self._failed(gpu, err)
                    continue
                self._take(gpu, samples, device, now, owners)
        wall = self._clock.wall()
        self._estimates.update({gpu: self.estimators[gpu].estimate(wall) for gpu in wanted})
        self._spans = {}

    def _read_submitted(self, now: float, owners: dict[int, str | None], gpus: Sequence[int]) -> None:
        """Submit a read for every GPU with none in flight, wait for them up to the read wait,
        take in those done (submitted this period or earlier); the rest stay in flight."""
        source = self._submitting
        assert source is not None
        for gpu in gpus:
            if gpu in self._in_flight or source.degraded(gpu) is not None:
                continue  # a stuck GPU takes no new calls: they would fail at once anyway
            try:
                asked = source.submit_process_samples(gpu, self._since[gpu])
                self._in_flight[gpu] = (asked, source.submit_device_utilization(gpu))
            except VcudaError as err:
                self._failed(gpu, err)
        until = self._clock.monotonic() + self._read_wait_s
        for gpu, got in collect_done(self._in_flight, until, self._clock):
            if isinstance(got, VcudaError):
                self._failed(gpu, got)
                continue
            samples, device = got
            self._take(gpu, samples, device, now, owners)

    def _take(
        self, gpu: int, samples: list[ProcessSample], device: int, now: float, owners: dict[int, str | None]
    ) -> None:
        estimator = self.estimators[gpu]
        self._fresh_at[gpu] = now
        self._last_error.pop(gpu, None)
        if samples:
            self._since[gpu] = max(self._since[gpu], *(s.timestamp_us for s in samples))
            self._learn_period(gpu)
        rows = []
        for s in samples:
            if s.pid not in owners:
                owners[s.pid] = self._owner(s.pid)
            rows.append((owners[s.pid], s.pid, s.timestamp_us, float(s.sm_util)))
        estimator.add_samples(rows)
        estimator.add_device(now, float(device))

    def _failed(self, gpu: int, err: VcudaError) -> None:
        self.errors += 1
        self._last_error[gpu] = str(err)
        self._report(gpu, f"cannot read GPU {gpu} utilization: {err}")

    def stale(self, gpu: int) -> str | None:
        """Why the GPU's figures cannot be acted on now (None: they can): a call stuck past
        its deadline, or no successful read for ``stale_after_s``."""
        if self._submitting is not None:
            degraded = self._submitting.degraded(gpu)
            if degraded is not None or gpu in self._in_flight:
                return degraded  # a read under way is the backend's deadline to judge
        age = self._clock.monotonic() - self._fresh_at.get(gpu, float("-inf"))
        if age <= self._stale_after_s:
            return None
        last = self._last_error.get(gpu)
        return f"no utilization reading for {age:.1f} s" + (f" ({last})" if last else "")

    def estimate(self, gpu: int) -> Estimate[str]:
        """The GPU's estimate over the plain window, as of the last read."""
        return self._estimates.get(gpu) or Estimate({}, "none", None)

    def measure(
        self, gpu: int, key: str, cycles: int, phase: int = 0, since_s: float | None = None
    ) -> Measurement | None:
        """The container's use over its latest whole cycles (``cycles`` control periods long,
        starting at periods ``phase`` modulo ``cycles``), all begun after ``since_s`` (when
        that length took effect); None: nothing to measure yet."""
        estimate = self.estimate(gpu)
        now = self._starts[-1][1] if self._starts else self._clock.wall()  # this period's start
        window = self._gains.window_for(cycles)
        estimator = self.estimators[gpu]
        if estimate.source == "none" or estimator.newest_us is None:
            return None
        device = estimator.device_mean(window)
        if device is not None and device < estimator.idle_percent:  # nobody ran: no samples come
            return Measurement(0.0, now - window, now, now, current=True, cycles=cycles)
        if estimate.source == "device-shares":  # the samples stalled: the device's reading now
            return Measurement(
                estimate.by_key.get(key, 0.0), now - window, now, now, current=True, cycles=cycles
            )
        newest = estimator.newest_us / 1_000_000
        floor = float("-inf") if since_s is None else since_s
        ends = [
            w
            for i, w in self._starts
            if (i - phase) % cycles == 0 and floor - CLOCK_TOL_S <= w <= newest + CLOCK_TOL_S
        ]
        begins = [w for w in ends if w <= ends[-1] - window + CLOCK_TOL_S] if ends else []
        if begins:
            span = (gpu, begins[-1], ends[-1])
            if span not in self._spans:
                self._spans[span] = estimator.usage_between(begins[-1], ends[-1])
            period = estimator.period_us() / 1_000_000
            used = self._spans[span].get(key, 0.0)
            return Measurement(used, begins[-1], ends[-1], now, cycles=cycles, sample_period_s=period)
        if since_s is not None:
            return None  # wait for whole cycles of the new length
        by_window = estimator.estimate(now, window) if window != self._gains.window_s else estimate
        return Measurement(by_window.by_key.get(key, 0.0), newest - window, newest, now, cycles=cycles)

    def forget(self, gpu: int, key: str) -> None:
        if gpu in self.estimators:
            self.estimators[gpu].forget(key)

    def _learn_period(self, gpu: int) -> None:
        """Ask the driver's sample period once (it does not change); a submitted ask is
        collected at a later read."""
        if gpu in self._period_asked:
            return
        estimator = self.estimators[gpu]
        if self._submitting is None:
            self._period_asked.add(gpu)
            estimator.sample_period_s = self._period_of(lambda: self._samples.sample_period_s(gpu), gpu)
            return
        pending = self._period_pending.get(gpu)
        if pending is None:
            try:
                self._period_pending[gpu] = self._submitting.submit_sample_period(gpu)
            except VcudaError as err:
                log.debug("GPU %d: sample period not asked yet (%s)", gpu, err)
        elif pending.wait(0):
            self._period_asked.add(gpu)
            estimator.sample_period_s = self._period_of(pending.result, gpu)

    def _period_of(self, ask: Callable[[], float | None], gpu: int) -> float | None:
        try:
            return ask()
        except VcudaError as err:
            log.debug("GPU %d: sample period unknown (%s): learned from the samples", gpu, err)
            return None

    def _owner(self, pid: int) -> str | None:
        try:
            ref = self._owner_of(pid)
        except VcudaError as err:
            log.debug("pid %d: %s", pid, err)
            return None
        return None if ref is None else container_key(ref.pod_uid, ref.container_id)
