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

from collections.abc import Callable, Sequence

from agent.clock import Clock
from agent.control.containers import ContainerControl, GpuView
from agent.control.dutycycle import CycleSchedule
from agent.control.usagemeter import SampleSource, UsageMeter
from agent.domain.dutycontrol import Gains, Measurement, Member, next_duty, targets
from agent.domain.specs import EnforcementSpec
from agent.platform.cgroups.paths import ContainerRef

FULL_DUTY = 0.98  # above this, freezing for a few ms is not worth two writes


class DutyLoop:
    """The duty cycles of the GPUs that use them (one control loop's, not thread-safe)."""

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
    ) -> None:
        """``blind(spec)``: the share of the GPU (percent) a container whose MPS limits are
        not trusted is held to by freezing alone (None: its limits are, or it has none)."""
        self.gains = gains
        self._blind = blind
        self.meter = UsageMeter(gpus, samples, owner_of, gains=gains, clock=clock, report=report)
        self.cycles = {g: CycleSchedule() for g in gpus}

    def begin(self, index: int, start: float, gpus: Sequence[int]) -> None:
        """Period ``index`` starts at ``start`` (monotonic): read ``gpus``."""
        wall = self.meter.period_started(index, start)
        for schedule in self.cycles.values():
            schedule.advance(index, wall)
        self.meter.read(gpus)

    def view(self, gpu: int, stale: str | None) -> GpuView:
        estimate = self.meter.estimate(gpu)
        device = self.meter.estimators[gpu].device_mean()
        cycle_s = self.cycles[gpu].length * self.gains.period_s
        return GpuView(gpu, device, estimate.source, cycle_s, stale)

    def control(self, gpu: int, controls: Sequence[ContainerControl]) -> list[ContainerControl]:
        """Duties from the measurements: the containers to hold (duty below full)."""
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
            if control.goal is not None and control.state.duty < FULL_DUTY:
                held.append(control)
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

    def actions(
        self, held: dict[int, list[ContainerControl]], index: int, start: float
    ) -> list[tuple[float, ContainerControl, bool]]:
        """(time, container, freeze?) for this period: a cycle starting thaws its GPU's held
        containers, each is frozen once its duty of the cycle has passed."""
        period = self.gains.period_s
        actions: list[tuple[float, ContainerControl, bool]] = []
        for gpu, controls in held.items():
            if not controls:
                continue
            schedule = self.cycles[gpu]
            schedule.request(max(c.state.cycles for c in controls), index)
            offset = schedule.offset(index)
            length_s = schedule.length * period
            cycle_start = start - offset * period
            for control in controls:
                control.cycle_s = length_s
                if offset == 0 and control.frozen:
                    actions.append((start, control, False))
                freeze_at = cycle_start + control.state.duty * length_s
                if (offset == 0 or not control.frozen) and freeze_at < start + period:
                    actions.append((max(start, freeze_at), control, True))
        return actions

    def measured(self, gpu: int, key: str) -> bool:
        estimator = self.meter.estimators.get(gpu)
        return estimator is not None and estimator.has_samples(key)

    def forget(self, gpu: int, key: str) -> None:
        self.meter.forget(gpu, key)
