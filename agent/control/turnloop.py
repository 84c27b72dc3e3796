"""Turns: how the compute-cap loop holds containers on a time-sliced GPU.

Per GPU, each control period:

1. :class:`~agent.control.turnmeter.TurnMeter` attributes the new device samples to
   containers through the agent's own record of whom it kept thawed when, and settles the
   held containers' accounts with it;
2. :meth:`TurnLoop.update` sets each container's target by policy (as the duty cycles did:
   fixed-share its cap; burst-share its ceiling while alone, its request while a neighbour
   is active; best-effort none) and decides who is *held* (:mod:`agent.control.turnholds`):
   a container measured over its target is held from then on; a held one that has not
   spent what it earned for ``idle_hold_s`` (it needs less than its share), or that used
   ``release_under_pp`` under its target for as long, is released; nobody is held on stale
   readings;
3. between periods, :meth:`TurnLoop.due` runs the turns (:mod:`agent.domain.turns`): at
   each turn's start the held container whose turn it is is thawed and every other held
   one is frozen; unheld containers that use the GPU *yield* (are frozen) during held
   containers' turns and run between them. So at most one held container runs at a time,
   alone: the device samples of its turn are its own, and its share is measured, not
   guessed.

The enforcer does the freezing and thawing (:mod:`agent.control.enforcer`) and tells the
meter what it did (``acted``), which is the record the attribution replays.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.control.containers import ContainerControl, GpuView
from agent.control.turnfigures import update_figures
from agent.control.turnholds import HoldChange, HoldClocks, hold_or_release, is_active, target, used_lately
from agent.control.turnmeter import TurnMeter
from agent.control.turntiming import cycle_length, drain_wait, ridden_end, rides
from agent.domain.turns import Cycle, Turn, TurnSettings, next_turn, nominal_cycle


@dataclass
class _GpuTurns:
    turn: Turn[str] | None = None
    next_decision: float = math.inf
    pending: list[tuple[float, str, bool]] = field(default_factory=list)  # (monotonic, key, thaw?)
    controls: dict[str, ContainerControl] = field(default_factory=dict)
    yielding: set[str] = field(default_factory=set)  # unheld containers that yield to turns
    order: list[str] = field(default_factory=list)  # ties go round-robin
    clocks: HoldClocks = field(default_factory=HoldClocks)  # toward a hold or a release
    thaws: dict[str, collections.deque[tuple[float, float]]] = field(default_factory=dict)
    cycle: Cycle[str] | None = None
    frozen_at: dict[str, float] = field(default_factory=dict)  # frozen lately, whose drain may run
    waiting_for: dict[str, float] = field(default_factory=dict)  # drains being watched (freeze time)
    expected: dict[str, float] = field(default_factory=dict)  # drain expected after its next freeze
    figured: dict[str, float] = field(default_factory=dict)  # status figures last worked out
    nominal_s: float = 0.0  # its cycle, stretched where crowded (0: not worked out yet)

    def crowded(self, settings: TurnSettings) -> bool:
        """Whether so many take turns here that its cycle stretched (turns ride, TurnSettings.ride_s)."""
        return self.nominal_s > settings.cycle_s + 1e-9

    def planned(self) -> list[float]:
        """When the loop is to wake for this GPU: its next decision and its pending actions."""
        return [self.next_decision, *(p[0] for p in self.pending)]


class TurnLoop:
    """The turns of the GPUs that run them (one control loop's, not thread-safe): a
    :class:`~agent.control.strategy.GpuStrategy`."""

    def __init__(
        self,
        gpus: Sequence[int],
        meter: TurnMeter,
        *,
        settings: TurnSettings,
        clock_now: Callable[[], float],
        idle_hold_s: float,
        period_s: float,
        view_window_s: float = 1.0,
    ) -> None:
        """``view_window_s``: the GPU's busy percent in status is over this long."""
        self.name = "turns"
        self.meter = meter
        self._period_s = period_s
        self._view_window_s = view_window_s
        self.settings = settings
        self._now = clock_now
        self._idle_hold_s = idle_hold_s
        self._gpus = {g: _GpuTurns() for g in gpus}

    # Each period --------------------------------------------------------------------------------
    @property
    def errors(self) -> int:
        return self.meter.errors

    def read(self, gpus: Sequence[int], index: int, start: float) -> None:
        """Take in the GPUs' new samples (a read not done in ``read_wait_share`` of the period
        is taken in later: the loop never waits on NVML)."""
        self.meter.read(gpus, wait_s=self.settings.read_wait_share * self._period_s)

    def stale(self, gpu: int) -> str | None:
        return self.meter.stale(gpu)

    def read_every(self, gpu: int) -> int:
        """Every period, except on a crowded GPU: where its cycle stretched n-fold (16 shares
        of 6 % in 1.6 s), once in n periods: each held container takes a turn a cycle, its
        account pays what the record predicts until the samples are read, and reading and
        deciding every period there cost the agent most of its CPU on a full node."""
        nominal = self._gpus[gpu].nominal_s
        return max(1, int(nominal / self.settings.cycle_s + 1e-9))

    def view(self, gpu: int, stale: str | None, controls: Sequence[ContainerControl]) -> GpuView:
        device = self.meter.device_percent(gpu, self._view_window_s)
        cycle = max((c.cycle_s for c in controls if c.throttled), default=0.0)
        return GpuView(gpu, device, "turns", cycle, stale)

    def take_over(self, gpu: int) -> None:
        """Nobody held: an account kept from before would pay now for all the GPU ran while
        another strategy held it (a container frozen for seconds to repay it). Who is over
        its target is held again from the samples, with a new account."""
        for key in list(self.meter.gpus[gpu].accounts):
            self._release(gpu, key)
        self.meter.gpus[gpu].unsettled.clear()
        self.reset(gpu)

    def schedule(self, gpu: int, held: Sequence[ContainerControl], index: int, start: float) -> None:
        """Nothing to plan per period: :meth:`due` decides each turn when its time comes."""

    def measured(self, gpu: int, key: str) -> bool:
        """Every container of a GPU read by device samples is measured (0 is a reading)."""
        return self.meter.gpus[gpu].last_stamp_s is not None

    def update(self, gpu: int, controls: Sequence[ContainerControl]) -> list[ContainerControl]:
        """Targets, figures and who is held; returns the containers the loop acts on (held
        ones and those that yield), the rest to be released."""
        now = self._now()
        state = self._gpus[gpu]
        data = self.meter.gpus[gpu]
        for key in set(state.controls) - {c.key for c in controls}:
            self._drop(gpu, key)
        for control in controls:
            if control.key not in state.controls:
                data.attribution.record(now, control.key, not control.frozen)
                state.order.append(control.key)
            state.controls[control.key] = control
        windows = (self.settings.used_window_s, self.settings.enter_window_s)
        used, recent = {}, {}
        for c in controls:
            used[c.key], recent[c.key] = self.meter.used_over(gpu, c.key, windows)
        models = data.attribution.models
        # A held container with work waits for its turns: it is active however seldom they come.
        active = {
            c.key
            for c in controls
            if (c.key in data.accounts and not (c.key in models and models[c.key].idle))
            or is_active(self.meter, self.settings, gpu, c.key, recent[c.key])
        }
        for control in controls:
            control.used = used[control.key] or 0.0
            control.goal = target(control, active)
        # Caps that take (nearly) the whole GPU between them: yielding to the held ones' turns
        # may cost an unheld one more than the slack left, so one short of its cap gets turns.
        booked = sum(c.goal or 0.0 for c in controls if c.key in active) >= self.settings.booked_percent
        for control in controls:
            change = hold_or_release(
                data,
                state.clocks,
                control,
                recent[control.key],
                now,
                settings=self.settings,
                idle_hold_s=self._idle_hold_s,
                booked=booked,
            )
            if change is HoldChange.RELEASE:
                self._release(gpu, control.key)
            elif change is HoldChange.HELD:
                state.next_decision = min(state.next_decision, now)
        held = set(data.accounts)
        data.free = {c.key for c in controls if c.key not in held}
        state.yielding = {
            c.key
            for c in controls
            if c.key not in held
            and held
            and (c.key in active or used_lately(self.meter, self.settings, gpu, c.key) or c.frozen)
            and (self.settings.capped_yield or c.goal is None)
        }
        nominal = state.nominal_s = nominal_cycle(self.settings, len(held) + len(state.yielding))
        for account in data.accounts.values():
            account.cycle_s = None if nominal == self.settings.cycle_s else nominal
        for control in controls:
            control.yielding = control.key in state.yielding
            self._figures(gpu, control, control.key in held, now)
        if held and state.next_decision == math.inf:
            state.next_decision = now
        over = data.attribution.drain_over
        if state.waiting_for and all(over.get(k, -math.inf) >= at for k, at in state.waiting_for.items()):
            state.waiting_for.clear()
            state.next_decision = min(state.next_decision, now)  # the drains showed: go on
        return [c for c in controls if c.key in held or c.key in state.yielding]

    def _release(self, gpu: int, key: str) -> None:
        state = self._gpus[gpu]
        self.meter.gpus[gpu].accounts.pop(key, None)
        state.clocks.released(key)
        state.pending = [p for p in state.pending if p[1] != key]
        if state.turn is not None and state.turn.key == key:
            state.next_decision = self._now()

    def forget(self, gpu: int, key: str) -> None:
        """The container is gone."""
        if key in self._gpus[gpu].controls:
            self._drop(gpu, key)
        else:
            self.meter.forget(gpu, key)

    def _drop(self, gpu: int, key: str) -> None:
        state = self._gpus[gpu]
        self._release(gpu, key)
        state.controls.pop(key, None)
        state.clocks.starved_since.pop(key, None)
        state.yielding.discard(key)
        state.thaws.pop(key, None)
        state.figured.pop(key, None)
        if key in state.order:
            state.order.remove(key)
        self.meter.forget(gpu, key)

    def reset(self, gpu: int) -> None:
        """Its containers were released (stale readings): no turn runs until it is fresh."""
        state = self._gpus[gpu]
        state.pending.clear()
        state.turn = None
        state.cycle = None
        state.next_decision = math.inf

    # Between periods ----------------------------------------------------------------------------
    def next_time(self) -> float:
        """When something is due next (monotonic)."""
        times = [s.next_decision for s in self._gpus.values()]
        times += [s.pending[0][0] for s in self._gpus.values() if s.pending]
        return min(times, default=math.inf)

    def due(self, now: float) -> list[tuple[int, ContainerControl, bool]]:
        """(GPU, container, thaw?) of every action due by ``now`` (a turn decided when its
        time has come); the enforcer acts and reports back with :meth:`acted`."""
        out = []
        for gpu, state in self._gpus.items():
            early = state.next_decision - now
            if early <= self.settings.slot_s or (
                state.crowded(self.settings) and rides(state.turn, early, self.settings)
            ):
                self._decide(gpu, now)
            while state.pending and state.pending[0][0] <= now + self.settings.slot_s:
                _, key, thaw = state.pending.pop(0)
                control = state.controls.get(key)
                if control is not None:
                    out.append((gpu, control, thaw))
        return out

    def acted(self, gpu: int, control: ContainerControl, thawed: bool, at: float) -> None:
        """The enforcer thawed (or froze) ``control`` at ``at``."""
        state = self._gpus.get(gpu)
        if state is None:
            return
        drain = None if thawed else state.expected.pop(control.key, None)
        self.meter.gpus[gpu].attribution.record(at, control.key, thawed, drain)
        thaws = state.thaws.setdefault(control.key, collections.deque())
        if thawed:
            thaws.append((at, math.inf))
        elif thaws and thaws[-1][1] == math.inf:
            thaws[-1] = (thaws[-1][0], at)

    def _decide(self, gpu: int, now: float) -> None:
        """The next turn, at ``now``: freeze whoever must not run in it, wait for their drains
        to run out, thaw its owner (or the unheld containers) until its end."""
        state = self._gpus[gpu]
        data = self.meter.gpus[gpu]
        state.turn = None
        state.pending.clear()
        state.waiting_for = {}
        if not data.accounts:
            state.next_decision = math.inf
            state.pending = [(now, k, True) for k in sorted(state.yielding)]
            return
        predicted = data.attribution.project(now)
        drains, rates, running = self._models(gpu)
        for key, expected in running.items():
            predicted[key] = predicted.get(key, 0.0) + expected
        if state.cycle is None or now >= state.cycle.end - self.settings.slot_s:
            start = now if state.cycle is None else max(now, state.cycle.end)
            state.cycle = Cycle(start, start + self._cycle_length(gpu))
        in_flight = {k: at + drains[k] for k, at in state.frozen_at.items() if k in drains}
        for key, expected in running.items():  # its last unit runs on after the freeze
            in_flight[key] = now + expected
        turn = next_turn(
            now,
            data.accounts,
            predicted,
            drains=drains,
            rates=rates,
            settings=self.settings,
            cycle=state.cycle,
            order=state.order,
            in_flight=in_flight,
        )
        owner = turn.key
        stopping = [k for k in data.accounts if k != owner] + (sorted(state.yielding) if owner else [])
        for key in stopping:  # a freeze for those that run (the frozen need none)
            control = state.controls.get(key)
            if control is not None and not control.frozen:
                state.frozen_at[key] = now
                state.pending.append((now, key, False))
        starting = [owner] if owner is not None else sorted(state.yielding)
        start = now + min(self.settings.max_drain_wait_s, self._guard(gpu, now, set(starting)))
        for key in starting:
            state.pending.append((start, key, True))
        if owner is not None:
            end = start + (turn.thaw_until - turn.start)
            if state.crowded(self.settings):
                planned = (t for g, other in self._gpus.items() if g != gpu for t in other.planned())
                end = ridden_end(turn, end, planned, self.settings)
            state.pending.append((end, owner, False))
            if turn.drain is not None:
                state.expected[owner] = turn.drain
            data.accounts[owner].waiting_since = end
            state.order.remove(owner)
            state.order.append(owner)
            state.next_decision = end

        else:
            state.next_decision = max(start, turn.next_decision)
        state.turn = turn
        state.pending.sort(key=lambda p: (p[0], p[2]))  # freezes first: one runs at a time

    def _models(self, gpu: int) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Per held container with a model: its drain, its rate, and (thawed now, so frozen by
        the next decision unless its turn goes on) the drain expected after that freeze."""
        state = self._gpus[gpu]
        data = self.meter.gpus[gpu]
        drains: dict[str, float] = {}
        rates: dict[str, float] = {}
        running: dict[str, float] = {}
        for key in data.accounts:
            model = data.attribution.models.get(key)
            if model is None:
                continue
            drains[key], rates[key] = model.drain_s, model.rate
            control = state.controls.get(key)
            if control is not None and not control.frozen:
                running[key] = state.expected.get(key, model.drain_s)
        return drains, rates, running

    def _cycle_length(self, gpu: int) -> float:
        data = self.meter.gpus[gpu]
        return cycle_length(
            self.settings,
            [*data.accounts, *self._gpus[gpu].yielding],
            data.attribution.models,
            data.typical_period(),
        )

    def _guard(self, gpu: int, now: float, starting: set[str]) -> float:
        state = self._gpus[gpu]
        data = self.meter.gpus[gpu]
        if any(not c.frozen for k, c in state.controls.items() if k in starting):
            return 0.0  # it runs already: the drains before it mix with its turn anyway
        # A drain over shows in the next device sample after it, read at the next period.
        seen_after = self.settings.seen_periods * data.typical_period() + self._period_s
        return drain_wait(
            now,
            starting,
            state.frozen_at,
            state.waiting_for,
            attribution=data.attribution,
            settings=self.settings,
            seen_after_s=seen_after,
        )

    # Figures --------------------------------------------------------------------------------------
    def held(self, gpu: int) -> set[str]:
        """The keys of the containers held on ``gpu`` (the rest of those acted on yield)."""
        return set(self.meter.gpus[gpu].accounts)

    def _figures(self, gpu: int, control: ContainerControl, held: bool, now: float) -> None:
        state = self._gpus[gpu]
        update_figures(
            control,
            self.meter.gpus[gpu].attribution.models.get(control.key),
            state.thaws.get(control.key, collections.deque()),
            state.figured,
            held=held,
            now=now,
            max_wait_s=self.settings.max_wait_s,
        )
