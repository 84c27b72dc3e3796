"""Duty cycles fed by NVML's per-process samples: how every GPU was held before the turns
(:mod:`agent.control.turnloop`), kept for GPUs under MPS (whose clients run concurrently,
so turns do not apply), for drivers without device samples, and to compare
(``--control-feedback nvml``).

Each control period: measure each container over its GPU's latest whole duty cycles from
the per-process samples (:mod:`agent.control.usagemeter`), set targets, duties and the
cycle length (:mod:`agent.domain.dutycontrol`), and list the thaws and freezes of the
throttled containers at the edges of their slices of the GPU's cycle that fall in the period
(:mod:`agent.control.dutycycle`). On a real GPU its measurement is wrong wherever contexts
time-slice (docs/gpu-model.md, "Why a fixed 30 ran at 66 % alone"): it is not what holds
caps on time-sliced GPUs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from agent.clock import Clock
from agent.control.containers import ContainerControl, GpuView
from agent.control.dutycycle import CycleSchedule
from agent.control.strategy import Action
from agent.control.usagemeter import SampleSource, UsageMeter
from agent.domain.dutycontrol import Gains, Measurement, Member, next_duty, targets
from agent.domain.specs import EnforcementSpec
from agent.platform.cgroups.paths import ContainerRef

FULL_DUTY = 0.98  # above this, freezing for a few ms is not worth two writes


class DutyLoop:
    """The duty cycles of the GPUs that use them (one control loop's, not thread-safe): a
    :class:`~agent.control.strategy.GpuStrategy`."""

    def __init__(
        self,
        gpus: Sequence[int],
        samples: SampleSource,
        owner_of: Callable[[int], ContainerRef | None],
        *,
        gains: Gains,
        clock: Clock,
        report: Callable[[int, str], None],
        blind: Callable[[EnforcementSpec], float | None] = lambda _spec: None,
        slot_s: float = 0.004,
    ) -> None:
        """``blind(spec)``: the share of the GPU (percent) a container whose MPS limits are
        not trusted is held to by freezing alone (None: its limits are, or it has none);
        ``slot_s``: actions this close together are due together."""
        self.name = "duty cycles"
        self.gains = gains
        self._blind = blind
        self._slot_s = slot_s
        self.meter = UsageMeter(gpus, samples, owner_of, gains=gains, clock=clock, report=report)
        self.cycles = {g: CycleSchedule() for g in gpus}
        self._held: dict[int, set[str]] = {}
        self._actions: list[tuple[float, int, int, ContainerControl, bool]] = []  # (at, n, GPU, c, freeze?)
        self._planned = 0

    @property
    def errors(self) -> int:
        return self.meter.errors

    def read(self, gpus: Sequence[int], index: int, start: float) -> None:
        """Period ``index`` starts at ``start`` (monotonic): read ``gpus``."""
        self._actions.clear()
        wall = self.meter.period_started(index, start)
        for schedule in self.cycles.values():
            schedule.advance(index, wall)
        self.meter.read(gpus)

    def stale(self, gpu: int) -> str | None:
        return self.meter.stale(gpu)

    def read_every(self, gpu: int) -> int:
        return 1  # a duty cycle is as long as a few periods: each one counts

    def reset(self, gpu: int) -> None:
        self._held.pop(gpu, None)
        self._actions = [a for a in self._actions if a[2] != gpu]
        heapq.heapify(self._actions)

    def take_over(self, gpu: int) -> None:
        """Nothing kept to drop: each period's duties come from the latest whole cycles."""
        self.reset(gpu)

    def held(self, gpu: int) -> set[str]:
        return set(self._held.get(gpu, ()))

    def view(self, gpu: int, stale: str | None, controls: Sequence[ContainerControl] = ()) -> GpuView:
        estimate = self.meter.estimate(gpu)
        device = self.meter.estimators[gpu].device_mean()
        cycle_s = self.cycles[gpu].length * self.gains.period_s
        return GpuView(gpu, device, estimate.source, cycle_s, stale)

    def update(self, gpu: int, controls: Sequence[ContainerControl]) -> list[ContainerControl]:
        """Duties from the measurements: the containers to hold (duty below full; nobody
        yields under duty cycles)."""
        measured = {c.key: self._measure(gpu, c.key) for c in controls}
        members = []
        for control in controls:
            seen = measured[control.key]
            if seen is not None:  # else: nothing new to measure yet, keep the last figure
                control.used = seen.used
            spec = control.spec
            members.append(Member(control.key, spec.policy, spec.cores, spec.cap, spec.ceiling, control.used))
        goals = targets(members)
        held = []
        for control in controls:
            control.goal = goals[control.key]
            blind = self._blind(control.spec)
            if blind is not None:
                control.goal = min(100.0 if control.goal is None else control.goal, blind)
            next_duty(control.state, measured[control.key], control.goal, self.gains)
            self._hold_blind(gpu, control, blind)
            control.yielding = False
            if control.goal is not None and control.state.duty < FULL_DUTY:
                held.append(control)
        self._held[gpu] = {c.key for c in held}
        return held

    def _hold_blind(self, gpu: int, control: ContainerControl, blind: float | None) -> None:
        """An untrusted MPS client NVML does not credit (it credits the MPS server) has no
        measurement to hold it by: it is thawed for ``blind`` % of each cycle, so that even at
        the whole GPU it uses no more than that."""
        if blind is not None and not self.measured(gpu, control.key):
            control.state.duty = min(1.0, blind / 100)
            control.held_blind = True
        elif control.held_blind:  # trusted now, or measured: the loop's own duty from here
            control.state.duty, control.held_blind = 1.0, False

    def _measure(self, gpu: int, key: str) -> Measurement | None:
        schedule = self.cycles[gpu]
        return self.meter.measure(gpu, key, schedule.length, schedule.phase, schedule.since_s)

    def schedule(self, gpu: int, held: Sequence[ContainerControl], index: int, start: float) -> None:
        """The period's actions on the GPU: a cycle starting thaws its held containers, each is
        frozen once its duty of the cycle has passed."""
        if not held:
            return
        period = self.gains.period_s
        schedule = self.cycles[gpu]
        schedule.request(max(c.state.cycles for c in held), index)
        offset = schedule.offset(index)
        length_s = schedule.length * period
        cycle_start = start - offset * period
        for control in held:
            control.cycle_s = length_s
            if offset == 0 and control.frozen:
                self._plan(start, gpu, control, freeze=False)
            freeze_at = cycle_start + control.state.duty * length_s
            if (offset == 0 or not control.frozen) and freeze_at < start + period:
                self._plan(max(start, freeze_at), gpu, control, freeze=True)

    def _plan(self, at: float, gpu: int, control: ContainerControl, *, freeze: bool) -> None:
        self._planned += 1
        heapq.heappush(self._actions, (at, self._planned, gpu, control, freeze))

    def next_time(self) -> float:
        return self._actions[0][0] if self._actions else math.inf

    def due(self, now: float) -> list[Action]:
        out: list[Action] = []
        while self._actions and self._actions[0][0] <= now + self._slot_s:
            _, _, gpu, control, freeze = heapq.heappop(self._actions)
            out.append((gpu, control, not freeze))
        return out

    def acted(self, gpu: int, control: ContainerControl, thawed: bool, at: float) -> None:
        """Nothing to record: the duty cycles read NVML's samples, not the thaw record."""

    def measured(self, gpu: int, key: str) -> bool:
        estimator = self.meter.estimators.get(gpu)
        return estimator is not None and estimator.has_samples(key)

    def forget(self, gpu: int, key: str) -> None:
        self._held.get(gpu, set()).discard(key)
        self.meter.forget(gpu, key)
