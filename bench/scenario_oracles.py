"""Experiments that split a controller's score into its decision and its accounting.

Registered with ``bench/scenarios.py`` on import (``--load scenario_oracles``):

- ``turns-oracle``: today's turns, their accounts settled with the engine's ground truth per
  device sample period (what each container really ran) instead of the attribution;
- ``buckets-oracle``: the candidate decision of :mod:`scenario_buckets` on the ground truth,
  read every control period;
- ``buckets-meter``: the same decision on the agent's own turn meter.

The ground truth is what no agent can read: these are upper bounds, to say how much of a
controller's shortfall is its decision and how much its reading (docs/benchmarks.md).

    .venv/bin/python bench/scenarios.py --load scenario_oracles \\
        --controllers turns,turns-oracle,buckets-oracle,buckets-meter
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scenario_buckets import BucketBook, Member
from scenarios import TurnsController, register

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.turnmeter import GpuTurnsData, TurnMeter
from agent.control.usagemeter import container_key
from agent.domain.specs import EnforcementSpec
from agent.domain.turns import TurnSettings
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.perfmon import PeriodUse

PERIOD_S = 0.25
HISTORY_S = 10.0
SWITCH_LOSS = 0.89  # the engine's useful share of busy time while contexts time-slice


class TurnsOracle(TurnsController):
    """Turns whose accounts are settled with what each container ran in each device sample
    period (the engine's perfmon record, keyed by the sample's stamp)."""

    def __init__(
        self, gpu: VirtualGpuNode, specs: Callable[[], list[EnforcementSpec]], clock: VirtualClock
    ) -> None:
        super().__init__(gpu, specs, clock)
        self._gpu = gpu
        self._truth: dict[int, dict[int, float]] = {}
        perfmon = gpu.node.engines[0].perfmon
        record, record_idle = perfmon.record, perfmon.record_idle

        def recorded(use: PeriodUse, stamp_us: int, end: float, visible: float, *, per_process: bool) -> None:
            self._truth[stamp_us] = dict(use.ran_by_pid)
            record(use, stamp_us, end, visible, per_process=per_process)

        def recorded_idle(periods: list[tuple[int, float, float]], period_s: float) -> None:
            for stamp, _end, _visible in periods:
                self._truth[stamp] = {}
            record_idle(periods, period_s)

        perfmon.record = recorded  # type: ignore[method-assign]
        perfmon.record_idle = recorded_idle  # type: ignore[method-assign]
        meter = self.enforcer.turns.meter
        settings = meter._settings

        def attribute(data: GpuTurnsData, end: float, period: float, util: float) -> None:
            data.attribution.take(end, period, util)  # the record's replay goes on (drains, rates)
            ran = self._truth.pop(round(end * 1e6), {})
            work: dict[str, float] = {}
            for pid, seconds in ran.items():
                ref = self._gpu.owner_of(pid)
                if ref is not None:
                    key = container_key(ref.pod_uid, ref.container_id)
                    work[key] = work.get(key, 0.0) + seconds
            data.busy.append((end, util / 100 * period))
            for key, seconds in work.items():
                data.work.setdefault(key, collections.deque()).append((end, seconds))
            for key, account in data.accounts.items():
                account.settle(end, work.get(key, 0.0), settings)

        meter._attribute = attribute  # type: ignore[method-assign]

        def no_corrections(data: GpuTurnsData) -> None:
            """The truth needs no credits' corrections."""

        meter._apply_credits = no_corrections  # type: ignore[method-assign]


class BucketsController:
    """:class:`scenario_buckets.BucketBook` driving the virtual freezer; measured by the
    engine's truth (``meter=False``) or by the agent's turn meter."""

    def __init__(
        self,
        gpu: VirtualGpuNode,
        specs: Callable[[], list[EnforcementSpec]],
        clock: VirtualClock,
        *,
        meter: bool,
    ) -> None:
        self.gpu, self.specs, self.clock = gpu, specs, clock
        self.book = BucketBook()
        self.frozen: dict[str, bool] = {}
        self.targets: dict[str, ThrottleTarget] = {}
        self.hist: dict[str, collections.deque[tuple[float, float, float]]] = collections.defaultdict(
            collections.deque
        )
        self.busy: collections.deque[tuple[float, float, float]] = collections.deque()
        self.thawed_since: dict[str, float] = {}
        self.thawed_s: dict[str, float] = collections.defaultdict(float)
        self.last_ran: dict[str, float] = {}
        self.last_t = clock.monotonic()
        self.measured_to = clock.monotonic()
        self.meter = (
            TurnMeter(
                [0], gpu, gpu.owner_of, settings=TurnSettings(), clock=clock, report=lambda _g, _m: None
            )
            if meter
            else None
        )
        self.seen_to: float | None = None
        self.measured_total: dict[str, float] = {}

    # Acting ------------------------------------------------------------------------------
    def _act(self, key: str, thaw: bool) -> None:
        if self.frozen.get(key) is (not thaw):
            return
        now = self.clock.monotonic()
        if thaw:
            self.thawed_since[key] = now
        elif key in self.thawed_since:
            self.thawed_s[key] += now - self.thawed_since.pop(key)
        self.frozen[key] = not thaw
        (self.gpu.thaw if thaw else self.gpu.freeze)(self.targets[key])
        if self.meter is not None:
            self.meter.gpus[0].attribution.record(now, key, thaw)

    def _thawed(self, key: str, now: float) -> float:
        seconds = self.thawed_s.pop(key, 0.0)
        if key in self.thawed_since:
            seconds += now - self.thawed_since[key]
            self.thawed_since[key] = now
        return seconds

    # Measuring ---------------------------------------------------------------------------
    def _measure(self, now: float, keys: list[str]) -> dict[str, float]:
        """Settle every bucket with what was measured since; returns what the record expects
        each container to have run since the measured time."""
        if self.meter is None:
            ran: dict[str, float] = {}
            for c in self.gpu.containers.values():
                key = container_key(c.ref.pod_uid, c.ref.container_id)
                ran[key] = c.process.ctx.ran - self.last_ran.get(key, 0.0)
                self.last_ran[key] = c.process.ctx.ran
            span, self.last_t = now - self.last_t, now
            together = sum(1 for v in ran.values() if v > 0.01 * span) >= 2
            self.busy.append((now, min(span, sum(ran.values()) / (SWITCH_LOSS if together else 1.0)), span))
            self._settle(now, ran, keys)
            return {}
        self.meter.read([0], wait_s=0.0)
        data = self.meter.gpus[0]
        fresh = [(e, b) for e, b in data.busy if self.seen_to is None or e > self.seen_to + 1e-9]
        for end, busy_s in fresh:
            self.busy.append((end, busy_s, data.typical_period()))
        if fresh:
            # What the meter measured since the last read, its credits' corrections included.
            work = {k: data.total.get(k, 0.0) - self.measured_total.get(k, 0.0) for k in keys}
            self.measured_total = {k: data.total.get(k, 0.0) for k in keys}
            self.seen_to = fresh[-1][0]
            self._settle(self.seen_to, work, keys)
        return data.attribution.project(now)

    def _settle(self, end: float, ran: dict[str, float], keys: list[str]) -> None:
        now = self.clock.monotonic()
        for key in keys:
            self.hist[key].append((end, ran.get(key, 0.0), self._thawed(key, now)))
            while self.hist[key] and self.hist[key][0][0] < end - HISTORY_S:
                self.hist[key].popleft()
            self.book.settle(key, end, ran.get(key, 0.0), self._unit(key)[1])
        while self.busy and self.busy[0][0] < end - HISTORY_S:
            self.busy.popleft()
        self.measured_to = end

    def _unit(self, key: str) -> tuple[float, float]:
        """(mean drain, longest unit) as the record learned them (none on the truth)."""
        model = self.meter.gpus[0].attribution.models.get(key) if self.meter is not None else None
        return (model.drain_s, model.drain_max_s) if model is not None else (0.0, 0.0)

    def _window(self, key: str, window_s: float) -> tuple[float, float]:
        since = self.measured_to - window_s
        entries = [(r, t) for e, r, t in self.hist.get(key, ()) if e > since]
        return sum(r for r, _ in entries), sum(t for _, t in entries)

    # The controller ----------------------------------------------------------------------
    def period(self) -> None:
        now = self.clock.monotonic()
        specs = {container_key(s.pod_uid, s.container_id): s for s in self.specs()}
        self.targets = {k: ThrottleTarget(s.container_id, None, None) for k, s in specs.items()}
        for key in [k for k in self.frozen if k not in specs]:
            del self.frozen[key]
            self.thawed_since.pop(key, None)
        for key in specs:
            if key not in self.frozen:
                self.frozen[key], self.thawed_since[key] = False, now
                if self.meter is not None:
                    self.meter.gpus[0].attribution.record(now, key, True)
        projected = self._measure(now, list(specs))
        s = self.book.settings
        members = []
        for key, spec in specs.items():
            ran, thawed = self._window(key, s.deprived_window_s)
            active, _ = self._window(key, s.active_window_s)
            drain, unit = self._unit(key)
            members.append(
                Member(
                    key=key,
                    policy=spec.policy,
                    request=spec.cores,
                    ceiling=spec.ceiling,
                    frozen=self.frozen[key],
                    used_pct=100 * ran / s.deprived_window_s,
                    thawed_frac=min(1.0, thawed / s.deprived_window_s),
                    active_pct=100 * active / s.active_window_s,
                    projected_s=projected.get(key, 0.0),
                    rate=min(1.0, ran / thawed) if thawed > 0.05 else 1.0,
                    drain_s=drain,
                    unit_s=unit,
                )
            )
        since = self.measured_to - s.deprived_window_s
        span = sum(p for e, _b, p in self.busy if e > since)
        busy_pct = 100 * sum(b for e, b, _p in self.busy if e > since) / span if span > 0 else 0.0
        for offset, key, thaw in self.book.plan(now, PERIOD_S, members, busy_pct, self.measured_to).actions:
            wait = now + offset - self.clock.monotonic()
            if wait > 0:
                self.clock.sleep(wait)
            self._act(key, thaw)

    def release_all(self) -> None:
        for key in list(self.frozen):
            self._act(key, True)

    def reading(self, spec: EnforcementSpec, window_s: float) -> tuple[float, float] | None:
        key = container_key(spec.pod_uid, spec.container_id)
        if self.meter is not None:
            used, end = self.meter.used(0, key, window_s), self.meter.gpus[0].last_stamp_s
            return None if used is None or end is None else (used, end)
        return 100 * self._window(key, window_s)[0] / window_s, self.measured_to


register("turns-oracle", TurnsOracle)
register("buckets-oracle", lambda gpu, specs, clock: BucketsController(gpu, specs, clock, meter=False))
register("buckets-meter", lambda gpu, specs, clock: BucketsController(gpu, specs, clock, meter=True))
