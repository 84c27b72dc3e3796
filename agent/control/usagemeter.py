"""Measuring each GPU container's use for the compute-cap loop.

Each control period the meter reads every GPU's new per-process samples and device
utilization, maps pids to containers and feeds one estimator per GPU
(:mod:`agent.domain.usage`). A container is then measured over whole duty cycles of its
own: from one of its cycle starts to a later one, the span at least the measurement window
and ending at the newest sample, so a long cycle's thawed and frozen parts are both counted
in full whatever the phase of the samples. Without enough history yet (a fresh start, a
cycle just lengthened) it is measured over the plain window ending at the newest sample.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from agent.clock import Clock
from agent.domain.dutycontrol import CLOCK_TOL_S, Gains, Measurement
from agent.domain.usage import Estimate, GpuUsageEstimator
from agent.errors import VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import ProcessSample

log = logging.getLogger(__name__)


class SampleSource(Protocol):
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]: ...

    def device_utilization(self, index: int) -> int: ...

    def sample_period_s(self, index: int) -> float | None: ...


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
    ) -> None:
        self._samples = samples
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

    def read(self) -> None:
        """Take in every GPU's new samples and its device utilization."""
        owners: dict[int, str | None] = {}
        now = self._clock.monotonic()
        for gpu, estimator in self.estimators.items():
            try:
                samples = self._samples.process_samples(gpu, self._since[gpu])
                device = self._samples.device_utilization(gpu)
            except VcudaError as err:
                self.errors += 1
                self._report(gpu, f"cannot read GPU {gpu} utilization: {err}")
                continue
            if samples:
                self._since[gpu] = max(self._since[gpu], *(s.timestamp_us for s in samples))
                if gpu not in self._period_asked:  # once: the driver's period does not change
                    self._period_asked.add(gpu)
                    estimator.sample_period_s = self._period_of(gpu)
            rows = []
            for s in samples:
                if s.pid not in owners:
                    owners[s.pid] = self._owner(s.pid)
                rows.append((owners[s.pid], s.pid, s.timestamp_us, float(s.sm_util)))
            estimator.add_samples(rows)
            estimator.add_device(now, float(device))
        wall = self._clock.wall()
        self._estimates = {gpu: e.estimate(wall) for gpu, e in self.estimators.items()}
        self._spans = {}

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

    def _period_of(self, gpu: int) -> float | None:
        try:
            return self._samples.sample_period_s(gpu)
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
