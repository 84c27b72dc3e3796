"""Who kept a GPU busy when: the agent's own record of whom it thawed and froze turns each
device sample's busy time into each container's share of it.

NVML's per-process samples credit whichever process happened to execute at the sample
instant (docs/gpu-model.md, the perfmon ring), so they are no measure of a share. The device samples are: the
busy percent of each sample period, every period. What they do not say is whose work it
was. The agent knows whom it kept thawed when, and it keeps held containers apart (one
thawed at a time, :mod:`.turns`). The record is replayed in a fluid model of the GPU:

- a thawed container runs at its ``rate`` (the share of the GPU it keeps busy while thawed
  alone: 1 for a loop that always has work queued), learned from periods it had to itself;
- a container frozen with work still queued runs that work on: its *drain* (the rest of a
  step, a CUDA graph), ``drain_s`` GPU seconds on average, learned from drains seen alone;
- contexts with work time-slice the GPU: the demand is divided max-min fairly, so a drain
  and the next container's first work share the GPU until the drain is done.

A sample's busy time goes first to the thawed containers, as much as the replay says they
ran; what is left over is the drains' (:meth:`Attribution.take`): a drain is the one figure
the agent cannot know in advance, so it takes the error. A drain seen with nobody else
running after it, until the GPU went quiet or the next thaw, is measured exactly; those
measurements are what ``drain_s`` is learned from.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

EPS = 1e-9
LEARN = 0.25  # weight of one new observation of a rate
DRAINS_KEPT = 16  # a container's drain figures are over its last this many
HIGH_QUANTILE = 0.8  # its long drain: this quantile of the recent ones
QUIET = 0.02  # a period busy less than this share of it: the GPU went quiet
ACTIVE_S = 0.001  # a container credited less than this in a period did not run in it
DRAIN_FLOOR_S = 0.002  # a frozen container is expected to run at least this (one short kernel)
WORKED_S = 0.005  # a frozen container credited this much in a period had work queued
TRUNCATED = 0.99  # a drain filling this much of the wait after it may have been cut short...
WAIT_GROWTH = 1.5  # ...and the next wait is this much longer
WAIT_MARGIN = 1.02  # the wait after a freeze: this much the long drain (> 1 / TRUNCATED)...
WAIT_SLACK_S = 0.005  # ...and this much more
WAIT_DECAY = 0.9  # a longer wait comes down to that by this factor per drain measured
MAX_WAIT_S = 4.0  # the longest wait after a freeze


@dataclass
class Demand:
    """What the record expects of one container."""

    rate: float = 1.0  # share of the GPU it keeps busy while thawed and alone
    drain_s: float = 0.0  # GPU seconds it runs after a freeze, on average
    drain_max_s: float = 0.0  # ...and at the high quantile
    drains: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=DRAINS_KEPT))
    idle: bool = False  # the last stretch it ran alone, it had no work
    wait_s: float | None = None  # how long nobody else runs after its freeze (None: until seen)
    runs_on_s: float = 0.0  # the last drain seen to fill its wait: at least this long (0: none)

    def observe_drain(self, seconds: float, waited_s: float | None = None) -> None:
        """A drain seen alone, after a wait of ``waited_s`` (None: it ran out with nobody
        thawed after it). One that filled its wait may have run on into the next turn: no
        measurement, and the next wait is longer."""
        if waited_s is not None and seconds >= TRUNCATED * waited_s:
            self.wait_s = min(MAX_WAIT_S, WAIT_GROWTH * max(waited_s, self.wait_s or 0.0))
            self.runs_on_s = seconds
            return
        self.runs_on_s = 0.0
        self.drains.append(seconds)
        ordered = sorted(self.drains)
        self.drain_s = sum(ordered) / len(ordered)
        self.drain_max_s = ordered[min(len(ordered) - 1, int(HIGH_QUANTILE * len(ordered)))]
        # Only drains shorter than their wait are measured: a wait that grew after one that
        # filled it comes down slowly, so that the long drains get measured too.
        target = min(MAX_WAIT_S, WAIT_MARGIN * self.drain_max_s + WAIT_SLACK_S)
        self.wait_s = max(target, WAIT_DECAY * (self.wait_s or 0.0))


def water_fill(demands: Mapping[K, float]) -> dict[K, float]:
    """Rates for demands each at most its own, the GPU divided max-min fairly."""
    if sum(demands.values()) <= 1.0:
        return {k: max(0.0, v) for k, v in demands.items()}  # room for all (the common case)
    out: dict[K, float] = {}
    left = 1.0
    order = sorted(demands, key=lambda k: demands[k])
    for n, key in enumerate(order):
        out[key] = max(0.0, min(demands[key], left / (len(order) - n)))
        left -= out[key]
    return out


@dataclass
class _Drain(Generic[K]):
    """Work a container left queued at a freeze: expected to run on ``left`` GPU seconds."""

    key: K
    at: float
    left: float
    credited: float = 0.0  # busy time credited to it so far
    clean: bool = True  # nobody else ran or drained meanwhile: a measurement of its drains
    until: float = float("inf")  # the next thaw after it: the wait for it ended then


class Attribution(Generic[K]):
    """The record in, device samples in, each container's GPU seconds out."""

    def __init__(self, start_s: float) -> None:
        self.t = start_s  # accounted for up to here (seconds, the record's clock)
        self.models: dict[K, Demand] = {}
        self._thawed: dict[K, float] = {}  # thawed since
        self._drains: list[_Drain[K]] = []  # drains that may still run, oldest first
        self._events: collections.deque[tuple[float, K, bool, float | None]] = collections.deque()
        self.drain_seen: dict[K, float] = {}  # when each container's drain was last measured
        self.drain_over: dict[K, float] = {}  # ...and when the last one was over, measured or not
        self._last_frozen: K | None = None
        self.last_candidates: frozenset[K] = frozenset()  # who could have run in the last sample's period
        self.last_thawed: dict[K, float] = {}  # ...and the share of that period each was thawed

    @property
    def replayed_to(self) -> float:
        return self.t

    def model(self, key: K) -> Demand:
        found = self.models.get(key)
        if found is None:
            found = self.models[key] = Demand()
        return found

    def record(self, at: float, key: K, thawed: bool, drain: float | None = None) -> None:
        """The agent thawed (or froze) ``key`` at ``at``; events come in time order. A freeze
        may say how much is expected to drain after it (else the container's mean drain):
        the turns know when they let a whole unit of work in."""
        self._events.append((max(at, self.t), key, thawed, drain))

    # Measuring -------------------------------------------------------------------------------
    def take(self, end_s: float, period_s: float, busy_percent: float) -> dict[K, float]:
        """One device sample (its period ends at ``end_s``): GPU seconds per container."""
        if end_s <= self.t + EPS:
            return {}  # a period already accounted for
        start = max(self.t, end_s - period_s)
        if start > self.t + EPS:
            self._replay(start, {}, {})  # samples missing: the time passes unaccounted
        busy = max(0.0, min(100.0, busy_percent)) / 100 * (end_s - start)
        running: dict[K, float] = {}
        draining: dict[K, float] = {}
        thawed_time: dict[K, float] = {}
        self._replay(end_s, running, draining, thawed_time)
        out: dict[K, float] = {}
        ran = sum(running.values())
        if any(v > EPS for v in draining.values()):
            given = min(busy, ran)  # the drains take what the thawed did not run
        else:  # no drain expected: the thawed ran it all, up to their thawed time
            given = min(busy, sum(thawed_time.values())) if ran > EPS else 0.0
        for key, seconds in running.items():
            out[key] = given * seconds / ran
        self._credit_drains(busy - given, draining, out)
        self.last_thawed = {k: v / (end_s - start) for k, v in thawed_time.items()}
        self.last_candidates = frozenset(
            [
                *thawed_time,
                *(k for k, v in draining.items() if v > EPS),
                *(k for k, v in out.items() if v > EPS),
            ]
        )
        for d in self._drains:
            if any(o is not d and o.at < d.until and d.at < o.until for o in self._drains):
                d.clean = False  # two drains at once: whose the busy time was is a guess
        self._learn(thawed_time, draining, busy, end_s - start)
        self._learn_idle(thawed_time, out, end_s - start)
        return {k: v for k, v in out.items() if v > EPS}

    def _learn_idle(self, thawed_time: Mapping[K, float], credited: Mapping[K, float], span: float) -> None:
        """Whether each container thawed for a good part of the period has work: credited
        next to nothing for it, it has none (idle); half of it or more, it has."""
        for key, ran in credited.items():
            if key not in thawed_time and ran >= WORKED_S:
                self.model(key).idle = False  # its drain ran: it had work at its last thaw
        for key, seconds in thawed_time.items():
            if seconds < 0.25 * span:
                continue
            ran = credited.get(key, 0.0)
            if ran < QUIET * seconds:
                self.model(key).idle = True
            elif ran >= 0.5 * seconds / max(1, len(thawed_time)):
                self.model(key).idle = False

    def _credit_drains(self, residual: float, draining: Mapping[K, float], out: dict[K, float]) -> None:
        """What the thawed containers did not run was drains: in proportion to what each was
        expected to drain, else (a drain longer than expected) the one frozen last."""
        if residual <= EPS:
            return
        expected = sum(draining.values())
        if expected > EPS:
            shares = {k: residual * v / expected for k, v in draining.items()}
        elif self._drains:
            shares = {self._drains[-1].key: residual}
        elif self._last_frozen is not None:
            shares = {self._last_frozen: residual}
        else:
            return
        for key, seconds in shares.items():
            out[key] = out.get(key, 0.0) + seconds
            for d in self._drains:
                if d.key == key:
                    d.credited += seconds

    def _replay(
        self,
        until: float,
        running: dict[K, float],
        draining: dict[K, float],
        thawed_time: dict[K, float] | None = None,
    ) -> None:
        """Replay the record up to ``until``: each container's predicted running and draining
        GPU seconds (and thawed seconds) added up."""
        while self.t < until - EPS:
            while self._events and self._events[0][0] <= self.t + EPS:
                self._apply(*self._events.popleft())
            end = min(until, self._events[0][0]) if self._events else until
            demand = {k: min(1.0, self.model(k).rate) for k in self._thawed}
            for d in self._drains:
                if d.left > EPS and d.key not in self._thawed:
                    demand[d.key] = 1.0
            rates = water_fill(demand)
            for d in self._drains:
                rate = rates.get(d.key, 0.0)
                if d.left > EPS and d.key not in self._thawed and rate > EPS:
                    end = min(end, self.t + d.left / rate)
            span = max(0.0, end - self.t)
            for key, rate in rates.items():
                if key in self._thawed:
                    running[key] = running.get(key, 0.0) + rate * span
                    if thawed_time is not None:
                        thawed_time[key] = thawed_time.get(key, 0.0) + span
            for d in self._drains:
                rate = rates.get(d.key, 0.0)
                if d.key not in self._thawed and rate > EPS:
                    work = min(d.left, rate * span)
                    d.left -= work
                    draining[d.key] = draining.get(d.key, 0.0) + work
            self.t = max(self.t, end)
        while self._events and self._events[0][0] <= self.t + EPS:
            self._apply(*self._events.popleft())

    def _apply(self, at: float, key: K, thawed: bool, drain: float | None) -> None:
        if thawed:
            if key not in self._thawed:
                self._thawed[key] = at
            for d in self._drains:
                d.until = min(d.until, at)

        elif key in self._thawed:
            del self._thawed[key]
            # Alone if nobody runs and every earlier drain's wait is over (the next thaw came);
            # with somebody running, its wait is over before it began.
            clean = not self._thawed and all(d.until <= at for d in self._drains)
            expected = self.model(key).drain_s if drain is None else drain
            until = at if self._thawed else float("inf")
            # Never expected to run nothing: a drain learned from drains that were never
            # credited (someone else's was expected instead) would stay at nothing.
            self._drains.append(_Drain(key, at, max(expected, DRAIN_FLOOR_S), clean=clean, until=until))
            self._last_frozen = key

    def _learn(
        self, thawed_time: Mapping[K, float], draining: Mapping[K, float], busy: float, span: float
    ) -> None:
        """A drain is over once the wait after it is (the next thaw is replayed), or the GPU
        went quiet with nobody thawed: measured if it was alone. One container thawed in the
        period and nobody else: whether it has work (a quiet period says it has none), and
        its busy share is its rate."""
        quiet = busy < QUIET * span
        keep = []
        for d in self._drains:
            waited = None if d.until == float("inf") else d.until - d.at
            if not ((waited is not None and d.until <= self.t + EPS) or (quiet and not self._thawed)):
                keep.append(d)
                continue
            if d.clean:
                self.model(d.key).observe_drain(d.credited, waited)
                self.drain_seen[d.key] = self.t
            self.drain_over[d.key] = self.t
        self._drains = keep
        if len(thawed_time) != 1:
            return
        ((key, seconds),) = thawed_time.items()
        model = self.model(key)
        if quiet:
            return  # an idle stretch says nothing about how busy it keeps the GPU with work
        if seconds >= 0.5 * span and not self._drains and not any(v > EPS for v in draining.values()):
            # Nobody else ran or drained in the period: its busy time was this one's.
            model.rate += LEARN * (min(1.0, busy / seconds) - model.rate)

    # Predicting -----------------------------------------------------------------------------
    def project(self, until: float) -> dict[K, float]:
        """GPU seconds each container is expected to have run from the accounted time to
        ``until``, with the drains still to come: what the agent has done that no device
        sample shows yet."""
        out: dict[K, float] = {}
        for d in self._drains:
            out[d.key] = out.get(d.key, 0.0) + max(0.0, d.left)
        thawed = dict(self._thawed)
        t = self.t
        for event_at, key, now_thawed, drain in [*self._events, (until, None, False, None)]:
            at = min(event_at, until)
            for k in thawed:
                out[k] = out.get(k, 0.0) + self.model(k).rate * max(0.0, at - t)
            t = max(t, at)
            if key is None:
                break
            if now_thawed:
                thawed.setdefault(key, at)
            elif key in thawed:
                del thawed[key]
                out[key] = out.get(key, 0.0) + (self.model(key).drain_s if drain is None else drain)
        return out

    def draining(self) -> dict[K, float]:
        """The containers whose drains may still run (as far as the device samples show), and
        when they froze."""
        return {d.key: d.at for d in self._drains}

    def forget(self, key: K) -> None:
        self.drain_over.pop(key, None)
        if self._last_frozen == key:
            self._last_frozen = None
        self._thawed.pop(key, None)
        self._drains = [d for d in self._drains if d.key != key]
        self._events = collections.deque(e for e in self._events if e[1] != key)
        self.models.pop(key, None)
        self.drain_seen.pop(key, None)

    def known(self) -> Iterable[K]:
        return self.models.keys()
