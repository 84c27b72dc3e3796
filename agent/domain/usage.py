"""Per-container GPU utilization from NVML-style samples: the estimator the controller uses.

What NVML gives, and what this does about it:

- Per-process SM samples (``nvmlDeviceGetProcessUtilization``) are taken by the driver on
  its own clock, one tick every 1/6 s to 1 s depending on the product, for the processes
  that were active in that tick; an idle (or frozen) process simply has no sample. They
  arrive late and in bursts (timestamps up to seconds old) and NOT_FOUND when nothing is
  new.
- Device utilization is current, but not per process.

The estimator keeps the driver's ticks by their own timestamps. A tick at ``t_k`` covers
``(t_(k-1), t_k]`` (at most ``max_gap_s``); a container's utilization is the
time-weighted mean of its processes' summed samples over the last ``window_s`` of *sample
time*, ending at the newest tick, with a missing sample counted as 0. Anchoring the window
to the samples' own clock rather than to now means late samples do not read as idleness,
and a burst of late samples lands in the ticks it belongs to. Samples older than the window
are ignored.

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
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_US = 1_000_000


@dataclass
class _Tick(Generic[K]):
    timestamp_us: int
    by_key: dict[K | None, float] = field(default_factory=dict)  # None: processes of no container


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
        max_gap_s: float = 1.0,
        stale_after_s: float = 3.0,
        idle_percent: float = 5.0,
    ) -> None:
        self.window_s = window_s
        self.idle_percent = idle_percent
        self.max_gap_s = max_gap_s
        self.stale_after_s = stale_after_s
        self._ticks: list[_Tick[K]] = []
        self._stamps: list[int] = []
        self._device: collections.deque[tuple[float, float]] = collections.deque()
        self._last_shares: dict[K, float] = {}
        self.newest_us: int | None = None

    def add_samples(self, samples: Iterable[tuple[K | None, int, float]]) -> None:
        """(container or None, timestamp in µs, SM percent) for each process sample."""
        for key, stamp, util in samples:
            i = bisect.bisect_left(self._stamps, stamp)
            if i == len(self._stamps) or self._stamps[i] != stamp:
                self._stamps.insert(i, stamp)
                self._ticks.insert(i, _Tick(stamp))
            tick = self._ticks[i]
            tick.by_key[key] = tick.by_key.get(key, 0.0) + util
            if self.newest_us is None or stamp > self.newest_us:
                self.newest_us = stamp
        self._trim()

    def add_device(self, now_s: float, util: float) -> None:
        """A device utilization reading (percent) at ``now_s`` (the same clock as estimate())."""
        self._device.append((now_s, util))
        while self._device and self._device[0][0] < now_s - self.window_s:
            self._device.popleft()

    def estimate(self, now_wall_s: float) -> Estimate[K]:
        if self.newest_us is None:
            return Estimate({}, "none", None)
        age = now_wall_s - self.newest_us / _US
        device = self.device_mean()
        if device is not None and device < self.idle_percent:
            # The device is current and says nobody uses the GPU: old samples must not
            # keep a container that stopped (or is frozen) looking busy.
            return Estimate({k: 0.0 for k in self._last_shares}, "device-idle", 0.0)
        shares = self._from_samples()
        if age <= self.stale_after_s:
            if shares:
                self._last_shares = dict(shares)
            return Estimate(shares, "samples", age)
        total = sum(self._last_shares.values())
        if device is None or total <= 0:
            return Estimate({k: 0.0 for k in self._last_shares}, "samples", age)
        return Estimate({k: device * v / total for k, v in self._last_shares.items()}, "device-shares", age)

    def device_mean(self) -> float | None:
        if not self._device:
            return None
        return sum(v for _, v in self._device) / len(self._device)

    def _from_samples(self) -> dict[K, float]:
        assert self.newest_us is not None
        start = self.newest_us - int(self.window_s * _US)
        sums: dict[K, float] = {}
        covered = 0.0
        for i in range(len(self._ticks) - 1, -1, -1):
            tick = self._ticks[i]
            if tick.timestamp_us <= start:
                break
            previous = self._stamps[i - 1] if i > 0 else None
            span = self._span(tick.timestamp_us, previous, start)
            if span <= 0:
                continue
            covered += span
            for key, util in tick.by_key.items():
                if key is not None:
                    sums[key] = sums.get(key, 0.0) + util * span
        if covered <= 0:
            return {}
        return {k: v / covered for k, v in sums.items()}

    def _span(self, stamp: int, previous: int | None, start: int) -> float:
        """Seconds of sample time a tick covers, inside the window."""
        if previous is None:
            # The first tick seen: assume a typical gap (the median of the known ones).
            gaps = [b - a for a, b in zip(self._stamps, self._stamps[1:], strict=False)]
            gap = sorted(gaps)[len(gaps) // 2] if gaps else int(self.max_gap_s * _US)
            previous = stamp - gap
        begin = max(previous, start, stamp - int(self.max_gap_s * _US))
        return (stamp - begin) / _US

    def _trim(self) -> None:
        if self.newest_us is None:
            return
        # Keep one tick before the window: it bounds the first tick inside it.
        horizon = self.newest_us - int((self.window_s + self.max_gap_s) * _US)
        cut = bisect.bisect_left(self._stamps, horizon)
        if cut > 1:
            del self._stamps[: cut - 1]
            del self._ticks[: cut - 1]

    def forget(self, key: K) -> None:
        self._last_shares.pop(key, None)
