"""Measuring what each container of a GPU ran, for the turns (:mod:`agent.control.turnloop`):
device samples attributed through the agent's own record of whom it thawed when
(:mod:`agent.domain.fluid`), corrected by NVML's per-process credits where the record cannot
tell (:mod:`agent.domain.credits`), and the held containers' accounts settled with it.

Each control period the meter reads the GPU's new device samples (``nvmlDeviceGetSamples``:
the busy percent of every sample period) and its per-process samples (``nvmlDeviceGetProcessUtilization``).
The device samples carry the measurement: each is split between the containers the record
says could have run then, and the split is each container's work. The per-process samples
decide where the record cannot: between containers that ran at the same time (unheld ones
thawed together, a drain under a neighbour's turn) each credit sets the credited
container's work over the credit's window and moves the difference from or to the others
beside it; the correction counts at the credit's instant and a held container's account
pays it over the next ``CreditSettings.settle_spread_s``. Before a credit comes, unheld
containers that ran together are split as NVML credited them recently; the credits also tell
whether an unheld container uses the GPU at all.

Time here is the control loop's monotonic clock; device samples are stamped in wall time and
converted with the clock's current offset.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Reversible, Sequence
from dataclasses import dataclass, field

from agent.clock import Clock
from agent.control.usagemeter import (
    STALE_AFTER_S,
    Pending,
    SampleSource,
    SubmittingSource,
    collect_done,
    container_key,
)
from agent.domain.credits import CreditBook, CreditSettings
from agent.domain.fluid import Attribution
from agent.domain.turns import Account, TurnSettings
from agent.errors import DeviceSamplesUnsupportedError, VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import DeviceSample, ProcessSample

log = logging.getLogger(__name__)

HISTORY_S = 30.0  # attributed work kept per container
CREDIT_WINDOW_S = 2.0  # per-process credits this recent split unheld containers' work
DEFAULT_PERIOD_S = 1 / 6  # the device sample period until two samples show it (NVML's shortest)


@dataclass
class GpuTurnsData:
    """One GPU's measurements."""

    attribution: Attribution[str]
    accounts: dict[str, Account] = field(default_factory=dict)
    work: dict[str, collections.deque[tuple[float, float]]] = field(default_factory=dict)  # (end, s)
    busy: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)  # (end, s)
    credits: collections.deque[tuple[float, str, float]] = field(default_factory=collections.deque)
    device_since_us: int = 0
    process_since_us: int = 0
    last_stamp_s: float | None = None
    gaps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))
    fresh_at: float = 0.0
    last_error: str = ""
    unsupported: str = ""  # the driver has no device samples here: the turns cannot run
    free: set[str] = field(default_factory=set)  # unheld containers (their work is split by credits)
    book: CreditBook[str] = field(default_factory=CreditBook)
    total: dict[str, float] = field(default_factory=dict)  # GPU seconds ever measured, corrections in
    unsettled: dict[str, float] = field(default_factory=dict)  # corrections held accounts still owe
    candidates: collections.deque[tuple[float, frozenset[str], str | None]] = field(
        default_factory=collections.deque
    )  # (end, who could have run in the period, who was thawed through nearly all of it)
    credits_applied_to: float = -math.inf  # the credits up to this instant corrected the split

    def typical_period(self) -> float:
        """The device sample period: the median of the recent gaps between samples."""
        if not self.gaps:
            return DEFAULT_PERIOD_S
        ordered = sorted(self.gaps)
        return ordered[len(ordered) // 2]


class TurnMeter:
    """Device and per-process samples in, each container's work out (one control loop's)."""

    def __init__(
        self,
        gpus: Sequence[int],
        samples: SampleSource,
        owner_of: Callable[[int], ContainerRef | None],
        *,
        settings: TurnSettings,
        clock: Clock,
        report: Callable[[int, str], None],
        stale_after_s: float = STALE_AFTER_S,
        credits: CreditSettings | None = None,
    ) -> None:
        self._samples = samples
        self._submitting = samples if isinstance(samples, SubmittingSource) else None
        self._owner_of = owner_of
        self._settings = settings
        self._clock = clock
        self._report = report
        self._stale_after_s = stale_after_s
        now = clock.monotonic()
        self._credits = credits or CreditSettings()
        self.gpus = {
            g: GpuTurnsData(Attribution(now), fresh_at=now, book=CreditBook(self._credits)) for g in gpus
        }
        self._in_flight: dict[int, tuple[Pending[list[DeviceSample]], Pending[list[ProcessSample]]]] = {}
        self.errors = 0

    def _offset(self) -> float:
        """Wall time minus monotonic time, now."""
        return self._clock.wall() - self._clock.monotonic()

    # Reading ------------------------------------------------------------------------------------
    def read(self, gpus: Iterable[int], wait_s: float) -> None:
        """Take in the new samples of ``gpus``. Against a backend whose reads run on per-GPU
        workers, a read not done within ``wait_s`` is taken in at a later call."""
        gpus = [g for g in gpus if not self.gpus[g].unsupported]
        if self._submitting is None:
            for gpu in gpus:
                data = self.gpus[gpu]
                try:
                    device = self._samples.device_samples(gpu, data.device_since_us)
                    processes = self._samples.process_samples(gpu, data.process_since_us)
                except VcudaError as err:
                    self._failed(gpu, err)
                    continue
                self._take(gpu, device, processes)
            return
        source = self._submitting
        for gpu in gpus:
            data = self.gpus[gpu]
            if gpu in self._in_flight or source.degraded(gpu) is not None:
                continue
            try:
                self._in_flight[gpu] = (
                    source.submit_device_samples(gpu, data.device_since_us),
                    source.submit_process_samples(gpu, data.process_since_us),
                )
            except VcudaError as err:
                self._failed(gpu, err)
        until = self._clock.monotonic() + wait_s
        for gpu, got in collect_done(self._in_flight, until, self._clock):
            if isinstance(got, VcudaError):
                self._failed(gpu, got)
                continue
            device, processes = got
            self._take(gpu, device, processes)

    def _take(self, gpu: int, device: list[DeviceSample], processes: list[ProcessSample]) -> None:
        data = self.gpus[gpu]
        data.fresh_at = self._clock.monotonic()
        data.last_error = ""
        self._take_processes(gpu, data, processes)
        self._take_device(data, device)
        self._apply_credits(data)

    def _failed(self, gpu: int, err: VcudaError) -> None:
        data = self.gpus[gpu]
        if isinstance(err, DeviceSamplesUnsupportedError):
            data.unsupported = str(err)
            log.warning("GPU %d: %s: its caps are held by NVML's per-process samples instead", gpu, err)
            return
        self.errors += 1
        data.last_error = str(err)
        self._report(gpu, f"cannot read GPU {gpu} utilization: {err}")

    def _take_processes(self, gpu: int, data: GpuTurnsData, samples: list[ProcessSample]) -> None:
        offset = self._offset()
        for s in samples:
            data.process_since_us = max(data.process_since_us, s.timestamp_us)
            key = self._key(s.pid)
            if key is not None and s.sm_util > 0:
                data.credits.append((s.timestamp_us / 1e6 - offset, key, float(s.sm_util)))
        horizon = self._clock.monotonic() - HISTORY_S
        while data.credits and data.credits[0][0] < horizon:
            data.credits.popleft()

    def _take_device(self, data: GpuTurnsData, samples: list[DeviceSample]) -> None:
        """Device samples tile time: each covers the time since the one before (a longer gap,
        samples lost, counts one typical period and leaves the rest unmeasured)."""
        offset = self._offset()
        for sample in sorted(samples, key=lambda s: s.timestamp_us):
            if sample.timestamp_us <= data.device_since_us:
                continue
            data.device_since_us = sample.timestamp_us
            end = sample.timestamp_us / 1e6 - offset
            typical = data.typical_period()
            period = typical if data.last_stamp_s is None else min(end - data.last_stamp_s, 1.5 * typical)
            if data.last_stamp_s is not None and end > data.last_stamp_s:
                data.gaps.append(end - data.last_stamp_s)
            data.last_stamp_s = end
            if period > 0:
                self._attribute(data, end, period, float(sample.util))

    def _attribute(self, data: GpuTurnsData, end: float, period: float, util: float) -> None:
        work = data.attribution.take(end, period, util)
        attribution = data.attribution
        through = [k for k, v in attribution.last_thawed.items() if v >= self._credits.solo_thawed_share]
        data.candidates.append((end, attribution.last_candidates, through[0] if len(through) == 1 else None))
        work = self._split_free(data, end, work)
        data.busy.append((end, util / 100 * period))
        for key, seconds in work.items():
            data.work.setdefault(key, collections.deque()).append((end, seconds))
            data.total[key] = data.total.get(key, 0.0) + seconds
        spread = min(1.0, period / self._credits.settle_spread_s)
        for key, account in data.accounts.items():
            # A credit's correction is paid over the next settle_spread_s, not at once: one
            # lump would lengthen or shorten a single turn (a latency spike), not the share.
            late = data.unsettled.pop(key, 0.0)
            if abs(late) > 1e-9:
                data.unsettled[key] = late * (1 - spread)
            account.settle(end, work.get(key, 0.0) + late * spread, self._settings)
        horizon = end - HISTORY_S
        for history in (data.busy, *data.work.values()):
            while history and history[0][0] < horizon:
                history.popleft()
        while data.candidates and data.candidates[0][0] < horizon:
            data.candidates.popleft()

    def _apply_credits(self, data: GpuTurnsData) -> None:
        """Each credit whose instant the device samples have reached corrects the split over
        its window (:mod:`agent.domain.credits`); a correction counts at the credit's instant
        (a later credit's window then holds it), however late the credit came."""
        end = data.last_stamp_s
        if end is None:
            return
        period = data.typical_period()
        window = data.book.window_s(period)
        due = [c for c in reversed(_tail(data.credits, data.credits_applied_to)) if c[0] <= end + 1e-6]
        if due:
            data.credits_applied_to = due[-1][0]
        for at, group in itertools.groupby(due, key=lambda o: o[0]):
            if at < end - HISTORY_S / 2:
                continue
            since, until = at - window + period / 2, at + period / 2  # the periods that end in it
            given = {k: max(0.0, _between(h, since, until)) for k, h in data.work.items()}
            periods = _candidates_between(data.candidates, since, until)
            quiet_since = since - (self._credits.solo_quiet_windows - 1) * window
            credited = {k for t, k, _u in _tail(data.credits, quiet_since) if t <= until}
            moved: dict[str, float] = {}
            for _at, key, value in group:
                # Alone: a turn of its own (thawed through every period, nobody else the record
                # says could have run), and NVML credited nobody else lately.
                alone = (
                    bool(periods)
                    and all(c <= {key} and owner == key for c, owner in periods)
                    and credited <= {key}
                )
                for k, seconds in data.book.correct(key, value, window, given, alone=alone).items():
                    given[k] = max(0.0, given.get(k, 0.0) + seconds)
                    moved[k] = moved.get(k, 0.0) + seconds
            for k, seconds in moved.items():
                _insert(data.work.setdefault(k, collections.deque()), at, seconds)
                data.total[k] = data.total.get(k, 0.0) + seconds
                if k in data.accounts:
                    data.unsettled[k] = data.unsettled.get(k, 0.0) + seconds

    def _split_free(self, data: GpuTurnsData, end: float, work: dict[str, float]) -> dict[str, float]:
        """Unheld containers that ran together time-sliced: split their work as NVML credited
        them recently (the record says only that they were all thawed)."""
        free = [k for k in work if k in data.free]
        if len(free) < 2:
            return work
        credit = dict.fromkeys(free, 0.0)
        for at, key, util in data.credits:
            if key in credit and end - CREDIT_WINDOW_S <= at <= end + CREDIT_WINDOW_S:
                credit[key] += util
        total_credit = sum(credit.values())
        if total_credit <= 0:
            return work
        pool = sum(work[k] for k in free)
        return {**work, **{k: pool * credit[k] / total_credit for k in free}}

    def _key(self, pid: int) -> str | None:
        try:
            ref = self._owner_of(pid)
        except VcudaError as err:
            log.debug("pid %d: %s", pid, err)
            return None
        return None if ref is None else container_key(ref.pod_uid, ref.container_id)

    # Figures -------------------------------------------------------------------------------------
    def used(self, gpu: int, key: str, window_s: float) -> float | None:
        """The container's share of the GPU (percent) over the last ``window_s`` of measured
        time; None before any device sample covered it."""
        data = self.gpus[gpu]
        if data.last_stamp_s is None:
            return None
        return max(0.0, 100 * _recent_sum(data.work.get(key, ()), data.last_stamp_s - window_s) / window_s)

    def used_over(
        self, gpu: int, key: str, windows: tuple[float, float]
    ) -> tuple[float | None, float | None]:
        """:meth:`used` over two windows, the longer first, in one pass over the history."""
        data = self.gpus[gpu]
        if data.last_stamp_s is None:
            return None, None
        longer, shorter = windows
        total = short = 0.0
        since_long, since_short = data.last_stamp_s - longer, data.last_stamp_s - shorter
        for end, seconds in reversed(data.work.get(key, ())):
            if end <= since_long:
                break
            if end > since_short:
                short += seconds
            total += seconds
        return max(0.0, 100 * total / longer), max(0.0, 100 * short / shorter)

    def credited(self, gpu: int, key: str, window_s: float) -> bool:
        """Whether NVML credited the container with GPU use in the last ``window_s``."""
        data = self.gpus[gpu]
        since = self._clock.monotonic() - window_s
        return any(k == key and at >= since for at, k, _u in data.credits)

    def device_percent(self, gpu: int, window_s: float) -> float | None:
        data = self.gpus[gpu]
        if data.last_stamp_s is None:
            return None
        return 100 * _recent_sum(data.busy, data.last_stamp_s - window_s) / window_s

    def stale(self, gpu: int) -> str | None:
        """Why the GPU's figures cannot be acted on now (None: they can)."""
        data = self.gpus[gpu]
        if self._submitting is not None:
            degraded = self._submitting.degraded(gpu)
            if degraded is not None or gpu in self._in_flight:
                return degraded  # a read under way is the backend's deadline to judge
        age = self._clock.monotonic() - data.fresh_at
        if age <= self._stale_after_s:
            return None
        return f"no utilization reading for {age:.1f} s" + (
            f" ({data.last_error})" if data.last_error else ""
        )

    def forget(self, gpu: int, key: str) -> None:
        data = self.gpus[gpu]
        data.attribution.forget(key)
        data.accounts.pop(key, None)
        data.work.pop(key, None)
        data.free.discard(key)
        data.book.forget(key)
        data.unsettled.pop(key, None)


def _recent_sum(history: Reversible[tuple[float, float]], since: float) -> float:
    """The seconds of a time-ordered (end, seconds) history that end after ``since``,
    newest first (a window is a small tail of the history)."""
    total = 0.0
    for end, seconds in reversed(history):
        if end <= since:
            break
        total += seconds
    return total


def _between(history: Reversible[tuple[float, float]], since: float, until: float) -> float:
    """The seconds of a time-ordered (end, seconds) history that end in (since, until]."""
    total = 0.0
    for end, seconds in reversed(history):
        if end <= since:
            break
        if end <= until:
            total += seconds
    return total


def _candidates_between(
    candidates: Reversible[tuple[float, frozenset[str], str | None]], since: float, until: float
) -> list[tuple[frozenset[str], str | None]]:
    """The (who could have run, who was thawed through) of the periods ending in (since,
    until], newest first, from a time-ordered history (a window is a small tail of it)."""
    out = []
    for end, could, through in reversed(candidates):
        if end <= since:
            break
        if end <= until:
            out.append((could, through))
    return out


def _insert(history: collections.deque[tuple[float, float]], end: float, seconds: float) -> None:
    """Add ``seconds`` at ``end`` to a time-ordered history (near its tail: a credit is
    recent), into the entry of that end where there is one (the history stays one entry a
    period however many credits correct it)."""
    i = len(history)
    while i > 0 and history[i - 1][0] > end + 1e-9:
        i -= 1
    if i > 0 and abs(history[i - 1][0] - end) <= 1e-9:
        history[i - 1] = (history[i - 1][0], history[i - 1][1] + seconds)
    elif i == len(history):
        history.append((end, seconds))
    else:
        history.insert(i, (end, seconds))


def _tail(history: Reversible[tuple[float, str, float]], since: float) -> list[tuple[float, str, float]]:
    """The entries of a time-ordered history after ``since`` (newest first)."""
    out = []
    for entry in reversed(history):
        if entry[0] <= since:
            break
        out.append(entry)
    return out
