"""Per-container GPU utilization from NVML-style samples: the estimator the controller uses.

What NVML gives, and what this does about it:

- Per-process SM samples (``nvmlDeviceGetProcessUtilization``) are taken by the driver on
  its own clock, one per sample period (1/6 s to 1 s depending on the product), each the
  share of that period the process ran, stamped with the period's end, and only for the
  processes that ran in it: an idle (or frozen) process simply has no sample. They arrive
  late and in bursts (timestamps up to seconds old) and NOT_FOUND when nothing is new.
- Device utilization is current, but not per process.

A sample stamped ``t`` covers ``(t - P, t]``, ``P`` the sample period: given by the backend
where it knows it, else learned as the smallest gap between two samples of one process. A
container's utilization is the sum, over its processes' samples, of each sample's value
weighted by how much of the window its period covers, divided by the window: time no
sample covers counts as idle, which it is (the driver reports every process that ran).
The window is the last ``window_s`` (at least one period) of *sample time*, ending at the
newest sample, so late samples do not read as idleness and a burst of them lands in the
periods it belongs to; before that much history exists, the window starts at the first
sample's period, and a container is measured from its own first sample's period on.

When the device utilization over the window says the GPU is idle, every container reads 0
at once (an idle GPU sends no per-process samples, so silence alone proves nothing). When
per-process samples stop arriving while the device says it is busy (a stalled NVML
sampler), the last known shares of each container are applied to the device utilization
averaged over the window, so a stall does not read as "everyone idle" (which would make the
controller thaw everything).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_US = 1_000_000
MIN_PERIOD_US = 10_000  # gaps shorter than this are driver timestamp noise, not a period
GAPS_KEPT = 64


@dataclass(frozen=True)
class Estimate(Generic[K]):
    """Utilization in percent of the GPU, per container, and how it was obtained."""

    by_key: Mapping[K, float]
    source: str  # "samples" | "device-shares" (samples stale) | "device-idle" | "none" (nothing yet)
    newest_sample_age_s: float | None


class GpuUsageEstimator(Generic[K]):
    """One GPU's samples; ``K`` identifies a container (e.g. a ContainerRef)."""

    def __init__(
        self,
        window_s: float = 1.0,
        max_period_s: float = 1.0,
        keep_s: float = 4.0,
        stale_after_s: float = 3.0,
        idle_percent: float = 5.0,
    ) -> None:
        self.window_s = window_s
        self.idle_percent = idle_percent
        self.max_period_s = max_period_s
        self.stale_after_s = stale_after_s
        self.keep_s = max(keep_s, window_s)  # samples this far behind the newest are dropped
        self.sample_period_s: float | None = None  # from the backend; None: learned
        self._stamps: list[int] = []  # sorted; parallel to _rows
        self._rows: list[tuple[int, K | None, float]] = []  # (pid, container, SM percent)
        self._seen: set[tuple[int, int]] = set()  # (pid, stamp) already counted
        self._last_by_pid: dict[int, int] = {}
        self._gaps: collections.deque[int] = collections.deque(maxlen=GAPS_KEPT)
        self._first_us: int | None = None
        self._first_by_key: dict[K, int] = {}  # each container's first sample
        self._device: collections.deque[tuple[float, float]] = collections.deque()
        self._last_shares: dict[K, float] = {}
        self.newest_us: int | None = None

    def add_samples(self, samples: Iterable[tuple[K | None, int, int, float]]) -> None:
        """(container or None, pid, timestamp in µs, SM percent) for each process sample."""
        for key, pid, stamp, util in samples:
            if (pid, stamp) in self._seen:
                continue  # read twice (a since-timestamp that overlapped)
            self._seen.add((pid, stamp))
            i = bisect.bisect_right(self._stamps, stamp)
            self._stamps.insert(i, stamp)
            self._rows.insert(i, (pid, key, util))
            last = self._last_by_pid.get(pid)
            if last is not None and stamp - last >= MIN_PERIOD_US:
                self._gaps.append(stamp - last)
            if last is None or stamp > last:
                self._last_by_pid[pid] = stamp
            if self.newest_us is None or stamp > self.newest_us:
                self.newest_us = stamp
            if self._first_us is None or stamp < self._first_us:
                self._first_us = stamp
            if key is not None and (key not in self._first_by_key or stamp < self._first_by_key[key]):
                self._first_by_key[key] = stamp
        self._trim()

    def period_us(self) -> int:
        """The driver's sample period: the backend's, else the smallest gap seen, else the
        longest a product uses (a first sample then covers all the history there is)."""
        if self.sample_period_s is not None:
            return max(MIN_PERIOD_US, int(self.sample_period_s * _US))
        if self._gaps:
            return min(int(self.max_period_s * _US), *self._gaps)
        return int(self.max_period_s * _US)

    def has_samples(self, key: K) -> bool:
        """Whether any per-process sample was ever credited to this container."""
        return key in self._first_by_key

    def add_device(self, now_s: float, util: float) -> None:
        """A device utilization reading (percent) at ``now_s`` (any clock, the same for all)."""
        self._device.append((now_s, util))
        while self._device and self._device[0][0] < now_s - self.keep_s:
            self._device.popleft()

    def estimate(self, now_wall_s: float, window_s: float | None = None) -> Estimate[K]:
        """Use per container over the last ``window_s`` of sample time (default: the
        estimator's window)."""
        if self.newest_us is None:
            return Estimate({}, "none", None)
        age = now_wall_s - self.newest_us / _US
        device = self.device_mean()
        if device is not None and device < self.idle_percent:
            # The device is current and says nobody uses the GPU: old samples must not
            # keep a container that stopped (or is frozen) looking busy.
            return Estimate({k: 0.0 for k in self._last_shares}, "device-idle", 0.0)
        shares = self._from_samples(self.window_s if window_s is None else window_s)
        if age <= self.stale_after_s:
            if shares:
                self._last_shares = dict(shares)
            return Estimate(shares, "samples", age)
        total = sum(self._last_shares.values())
        if device is None or total <= 0:
            return Estimate({k: 0.0 for k in self._last_shares}, "samples", age)
        return Estimate({k: device * v / total for k, v in self._last_shares.items()}, "device-shares", age)

    def device_mean(self, window_s: float | None = None) -> float | None:
        """Mean device utilization over the last ``window_s`` of readings (default: the window)."""
        if not self._device:
            return None
        since = self._device[-1][0] - (self.window_s if window_s is None else window_s)
        recent = [v for t, v in self._device if t >= since]
        return sum(recent) / len(recent)

    def _from_samples(self, window_s: float) -> dict[K, float]:
        assert self.newest_us is not None
        end = self.newest_us
        return self._usage(end - max(int(window_s * _US), self.period_us()), end)

    def usage_between(self, start_s: float, end_s: float) -> dict[K, float]:
        """Use per container over ``[start_s, end_s]`` of sample time (wall clock); time
        before the first sample's period is left out."""
        if self.newest_us is None:
            return {}
        return self._usage(int(start_s * _US), min(int(end_s * _US), self.newest_us))

    def _usage(self, start: int, end: int) -> dict[K, float]:
        assert self._first_us is not None
        period = self.period_us()
        start = max(start, self._first_us - period)
        sums: dict[K, float] = {}
        for i in range(bisect.bisect_right(self._stamps, start), len(self._stamps)):
            stamp = self._stamps[i]
            if stamp - period >= end:
                break
            _pid, key, util = self._rows[i]
            if key is None:
                continue
            covered = min(stamp, end) - max(stamp - period, start)
            if covered > 0:
                sums[key] = sums.get(key, 0.0) + util * covered
        # A container whose first sample falls inside the span is measured from then on:
        # the time before it ran at all is not its idleness.
        out = {}
        for k, v in sums.items():
            length = end - max(start, self._first_by_key.get(k, start) - period)
            if length > 0:
                out[k] = v / length
        return out

    def _trim(self) -> None:
        if self.newest_us is None:
            return
        horizon = self.newest_us - int((self.keep_s + self.max_period_s) * _US)
        cut = bisect.bisect_left(self._stamps, horizon)
        if cut > 0:
            for stamp, (pid, _key, _util) in zip(self._stamps[:cut], self._rows[:cut], strict=True):
                self._seen.discard((pid, stamp))
            del self._stamps[:cut]
            del self._rows[:cut]
            self._last_by_pid = {p: s for p, s in self._last_by_pid.items() if s >= horizon}

    def forget(self, key: K) -> None:
        self._last_shares.pop(key, None)
        self._first_by_key.pop(key, None)
