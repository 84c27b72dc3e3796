"""What a simulated GPU's driver records of its use, per sample period: the view NVML reads
(:mod:`.nvmllib` is the NVML library's part of it).

Two views (``EngineConfig.nvml_view``):

- ``driver`` (the default): the driver's perfmon sample ring (docs/reference.md, "The
  driver's samples", from open-gpu-kernel-modules). Every sample period the driver takes ONE
  per-process sample, stamped with the period's end, crediting ONE process: the one whose
  context is executing on the engine at that instant. A sample taken while the engine idles
  credits nobody, so the busy time before it is lost to every process. What the sample
  credits (``EngineConfig.sample_credit``):

  - ``resident`` (the default): the SM activity of the credited process's own contexts
    over the last ``credit_window_s``. Fitted to the recorded H100 figures (docs/gpu-model.md):
    two time-sliced loops read about 43 % together while they run 88 % of the GPU between
    them, and a loop held to a duty cycle reads about its duty squared;
  - ``engine``: the whole engine's SM activity over the sample period (the reading of the
    driver's code in docs/reference.md), which credits a pair with their sum.

  SM activity is not busy time: a kernel keeps part of the SMs busy on average
  (``sm_activity``: a 4096² fp32 matmul loop alone read 86.7 % on an H100), and a context
  switch keeps the engine busy with no SM working. The ring holds :data:`RING_SAMPLES`.
  A device sample (busy percent of the period: "one or more kernels executing", as
  ``nvmlDeviceGetSamples`` and ``nvmlDeviceGetUtilizationRates`` document it) is taken at
  the same instant, busy or not, and is visible at once.
- ``exact``: the ideal the engine used to report (kept to compare): every process that ran
  in the period gets its own sample, its share of the period.

Under MPS with the ``server`` attribution the clients' work is credited to the MPS server
process (NVIDIA's MPS documentation; seen on an H200); ``client`` attribution, and MPS
without a server, give each client its own sample, as in the exact view.

Per-process samples become visible late (``visible``), in order.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

from agent.platform.gpu.inventory import DeviceSample

NVML_VIEWS = ("driver", "exact")
SAMPLE_CREDITS = ("resident", "engine")
RING_SAMPLES = 72  # the driver's perfmon ring (NV2080_CTRL_PERF_GPUMON_SAMPLE_COUNT_PERFMON_UTIL)
DEVICE_SAMPLES_KEPT = 4096
EXACT_SAMPLES_KEPT = 4096
NO_PROCESS = 0  # a ring sample taken while the engine idled credits no process


@dataclass(frozen=True)
class Sample:
    """One per-process sample as the driver holds it (``pid`` 0: none credited)."""

    pid: int
    timestamp_us: int  # the end of its sample period, wall clock
    sm_util: int  # percent


@dataclass(frozen=True)
class PeriodUse:
    """What happened on the engine in one sample period (seconds)."""

    period_s: float
    ran_by_pid: Mapping[int, float]  # GPU time each process's contexts executed
    activity_by_pid: Mapping[int, float]  # SM-seconds: ran x each context's SM activity
    busy_s: float  # any context executing or being switched in
    executing_pid: int  # the process executing at the period's end (NO_PROCESS: idle)


class Perfmon:
    """The sample buffers of one GPU's driver, in the view its config asks for."""

    def __init__(self, view: str, credit: str = "resident", credit_periods: int = 1) -> None:
        self.view = view
        self.credit = credit
        self._recent: collections.deque[PeriodUse] = collections.deque(maxlen=max(1, credit_periods))
        kept = RING_SAMPLES if view == "driver" else EXACT_SAMPLES_KEPT
        self._samples: collections.deque[tuple[float, Sample]] = collections.deque(maxlen=kept)
        self._device: collections.deque[tuple[float, DeviceSample]] = collections.deque(
            maxlen=DEVICE_SAMPLES_KEPT
        )

    def record(self, use: PeriodUse, stamp_us: int, end: float, visible: float, *, per_process: bool) -> None:
        """The samples of the period that ended at ``end`` (monotonic): the device's is read
        at once, the per-process ones from ``visible`` on. ``per_process``: every process gets
        its own sample whatever the view (MPS clients credited each to itself)."""
        period = use.period_s
        self._device.append((end, DeviceSample(stamp_us, min(100, round(100 * use.busy_s / period)))))
        self._recent.append(use)
        if self.view == "driver" and not per_process:
            self._samples.append((visible, Sample(use.executing_pid, stamp_us, self._credited(use))))
            return
        for pid, seconds in use.ran_by_pid.items():
            share = min(100, round(100 * seconds / period))
            if share > 0:
                self._samples.append((visible, Sample(pid, stamp_us, share)))

    def _credited(self, use: PeriodUse) -> int:
        if use.executing_pid == NO_PROCESS:
            return 0
        if self.credit == "engine":
            return min(100, round(100 * sum(use.activity_by_pid.values()) / use.period_s))
        span = sum(u.period_s for u in self._recent)
        own = sum(u.activity_by_pid.get(use.executing_pid, 0.0) for u in self._recent)
        return min(100, round(100 * own / span))

    def record_idle(self, periods: list[tuple[int, float, float]], period_s: float) -> None:
        """Whole idle periods, each (stamp, its end, when the driver shows it): device samples
        at 0 and, in the driver's ring, a sample each that credits nobody."""
        for stamp, end, _visible in periods[-DEVICE_SAMPLES_KEPT:]:
            self._device.append((end, DeviceSample(stamp, 0)))
        idle = PeriodUse(period_s, {}, {}, 0.0, NO_PROCESS)
        self._recent.extend([idle] * min(len(periods), self._recent.maxlen or 1))
        if self.view == "driver":
            for stamp, _end, visible in periods[-RING_SAMPLES:]:
                self._samples.append((visible, Sample(NO_PROCESS, stamp, 0)))

    def samples(self, since_us: int, now: float) -> list[Sample]:
        """The driver's per-process samples newer than ``since_us`` visible at ``now``."""
        return [s for visible, s in self._samples if visible <= now and s.timestamp_us > since_us]

    def device_samples(self, since_us: int, now: float) -> list[DeviceSample]:
        return [s for visible, s in self._device if visible <= now and s.timestamp_us > since_us]

    def last_device_util(self, now: float) -> int:
        """The newest visible device sample (``nvmlDeviceGetUtilizationRates``)."""
        for visible, sample in reversed(self._device):
            if visible <= now:
                return sample.util
        return 0
