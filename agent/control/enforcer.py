"""The compute-cap loop: measure each GPU container's use, set its duty, run the duty cycle.

Each control period (``period_s``), in one thread:

1. read each GPU's new per-process samples and device utilization and measure each
   container over its GPU's latest whole duty cycles (:mod:`agent.control.usagemeter`);
2. compute targets, duties and the cycle length each container needs
   (:mod:`agent.domain.dutycontrol`) from the specs;
3. thaw and freeze the throttled containers at the edges of their slices of the GPU's
   cycle (:mod:`agent.control.dutycycle`) that fall in this period, earliest first.

A frozen container is thawed again within one cycle (at most ``max_cycle_s``). A GPU
whose readings are stale (a backend call stuck, reads failing: ``UsageMeter.stale``) has
all its containers released (thawed, not held) until readings come back: the loop never
holds a container on figures it does not have. A freeze that fails (the freeze journal
cannot be written, the freezer refused) is skipped and undone: nothing stays paused that
the journal may not list.
The actuator (freezer or signals) is behind :class:`~agent.control.actuators.Actuator`;
this loop does not know which. When the loop ends, for any reason, everything it froze is
thawed. Time comes from a :class:`~agent.clock.Clock`, so tests drive it virtually.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.clock import Clock, SystemClock
from agent.control.actuators import Actuator, ThrottleTarget
from agent.control.dutycycle import CycleSchedule
from agent.control.usagemeter import SampleSource, UsageMeter, container_key
from agent.domain.dutycontrol import DutyState, Gains, Measurement, Member, next_duty, targets
from agent.domain.specs import EnforcementSpec
from agent.errors import VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.freezejournal import JournalError

log = logging.getLogger(__name__)

FULL_DUTY = 0.98  # above this, freezing for a few ms is not worth two writes
FREEZE_SLOT_S = 0.004  # actions due this close together share one wake-up
NOT_FOUND = "the container's cgroup was not found (yet)"
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class ContainerControl:
    """What the loop knows about one GPU container (also what status and metrics show)."""

    spec: EnforcementSpec
    key: str
    state: DutyState
    target: ThrottleTarget | None = None
    used: float = 0.0
    goal: float | None = None  # the target utilization this period; None: not throttled
    frozen: bool = False
    frozen_s: float = 0.0  # total time frozen
    freezes: int = 0  # throttle actions (freezes)
    frozen_at: float = 0.0
    throttled: bool = False  # held below what it would use (duty < 1)
    problem: str = ""  # the last actuator error, for status
    cycle_s: float = 0.0  # its GPU's duty cycle while it is throttled


@dataclass(frozen=True)
class GpuView:
    index: int
    device_percent: float | None
    source: str
    cycle_s: float = 0.0
    stale: str | None = None  # why its containers are not held now (None: readings are fresh)


@dataclass
class EnforcerStats:
    periods: int = 0
    overruns: int = 0  # periods that started late by more than a period
    measure_errors: int = 0
    actuator_errors: int = 0
    last_period_s: float = 0.0  # work time of the last period (not counting sleeps)
    # Work time per period as a cumulative histogram (Prometheus buckets), for metrics.
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS_S))
    duration_sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.last_period_s = seconds
        self.duration_sum_s += seconds
        for i, bound in enumerate(DURATION_BUCKETS_S):
            if seconds <= bound:
                self.bucket_counts[i] += 1


class Enforcer:
    def __init__(
        self,
        *,
        gpus: Sequence[int],
        samples: SampleSource,
        specs: Callable[[], Sequence[EnforcementSpec]],
        owner_of: Callable[[int], ContainerRef | None],
        locate: Callable[[EnforcementSpec], ThrottleTarget | None],
        actuator: Actuator,
        period_s: float = 0.25,
        gains: Gains | None = None,
        clock: Clock | None = None,
        enabled: bool = True,
    ) -> None:
        self._gpus = tuple(gpus)
        self._specs = specs
        self._locate = locate
        self.actuator = actuator
        self.period_s = period_s
        self.gains = gains or Gains(period_s=period_s)
        self._clock = clock or SystemClock()
        self.enabled = enabled
        self.meter = UsageMeter(
            self._gpus, samples, owner_of, gains=self.gains, clock=self._clock, report=self._report
        )
        self._cycles = {g: CycleSchedule() for g in self._gpus}
        self._controls: dict[str, ContainerControl] = {}
        self._views: dict[int, GpuView] = {}
        self._lock = threading.Lock()
        self._reported: set[tuple[int, str]] = set()
        self._stale: dict[int, str] = {}  # GPUs whose containers are released, and why
        self.stats = EnforcerStats()
        # (container label, action, detail) when a container starts or stops being throttled
        self.on_action: list[Callable[[str, str, str], object]] = []

    # The loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        next_start = self._clock.monotonic()
        try:
            while not stop.is_set():
                started = self._clock.monotonic()
                if started - next_start > self.period_s:
                    self.stats.overruns += 1
                    next_start = started
                self.period(stop, next_start)
                next_start += self.period_s
                self._clock.sleep(next_start - self._clock.monotonic(), stop)
        finally:
            self.release_all()

    def period(self, stop: threading.Event | None = None, start: float | None = None) -> None:
        """One control period (see the module docstring)."""
        start = self._clock.monotonic() if start is None else start
        work_start = self._clock.monotonic()
        index = self.stats.periods
        wall = self.meter.period_started(index, start)
        for schedule in self._cycles.values():
            schedule.advance(index, wall)
        self.meter.read()
        self.stats.measure_errors = self.meter.errors
        throttled = self._control(index)
        self.stats.periods += 1
        self.stats.observe(self._clock.monotonic() - work_start)
        if not self.enabled:
            return
        actions = sorted(self._actions(throttled, index, start), key=lambda action: action[0])
        i = 0
        while i < len(actions):
            wait = actions[i][0] - self._clock.monotonic()
            if wait > 0 and self._clock.sleep(wait, stop):
                return  # stopping: run()'s finally thaws
            # Everything due within the next slot goes in this wake-up.
            due = self._clock.monotonic() + FREEZE_SLOT_S
            while i < len(actions) and actions[i][0] <= due:
                _, control, freeze = actions[i]
                with self._lock:
                    if freeze and not control.frozen and control.throttled:
                        self._freeze(control)
                    elif not freeze:
                        self._thaw(control)
                i += 1

    def _actions(
        self, throttled: dict[int, list[ContainerControl]], index: int, start: float
    ) -> list[tuple[float, ContainerControl, bool]]:
        """(time, container, freeze?) for this period: a cycle starting thaws its GPU's
        throttled containers, each is frozen once its duty of the cycle has passed."""
        actions: list[tuple[float, ContainerControl, bool]] = []
        for gpu, controls in throttled.items():
            if not controls:
                continue
            schedule = self._cycles[gpu]
            schedule.request(max(c.state.cycles for c in controls), index)
            offset = schedule.offset(index)
            length_s = schedule.length * self.period_s
            cycle_start = start - offset * self.period_s
            for control in controls:
                control.cycle_s = length_s
                if offset == 0 and control.frozen:
                    actions.append((start, control, False))
                freeze_at = cycle_start + control.state.duty * length_s
                if (offset == 0 or not control.frozen) and freeze_at < start + self.period_s:
                    actions.append((max(start, freeze_at), control, True))
        return actions

    # Controlling ------------------------------------------------------------------------------
    def _control(self, index: int) -> dict[int, list[ContainerControl]]:
        """Duties from the measurements; the throttled containers per GPU."""
        by_gpu: dict[int, dict[str, EnforcementSpec]] = {gpu: {} for gpu in self._gpus}
        for spec in self._specs():
            if spec.container_id and spec.gpus and spec.gpus[0] in by_gpu:
                by_gpu[spec.gpus[0]][container_key(spec.pod_uid, spec.container_id)] = spec
        throttled: dict[int, list[ContainerControl]] = {}
        with self._lock:
            current = {key for specs in by_gpu.values() for key in specs}
            for key in self._controls.keys() - current:
                self._drop(self._controls.pop(key))
            for gpu, on_gpu in by_gpu.items():
                estimate = self.meter.estimate(gpu)
                device = self.meter.estimators[gpu].device_mean()
                cycle_s = self._cycles[gpu].length * self.period_s
                stale = self._note_stale(gpu, self.meter.stale(gpu))
                self._views[gpu] = GpuView(gpu, device, estimate.source, cycle_s, stale)
                controls = [self._control_of(key, spec) for key, spec in on_gpu.items()]
                if stale is not None:
                    for control in controls:  # fail safe: thawed and left alone
                        control.goal = None
                        self._release(control)
                    throttled[gpu] = []
                    continue
                measured = {c.key: self._measure(gpu, c.key) for c in controls}
                members = []
                for control in controls:
                    seen = measured[control.key]
                    if seen is not None:  # else: nothing new to measure yet, keep the last figure
                        control.used = seen.used
                    spec = control.spec
                    members.append(
                        Member(control.key, spec.policy, spec.cores, spec.cap, spec.ceiling, control.used)
                    )
                goals = targets(members)
                held = throttled[gpu] = []
                for control in controls:
                    control.goal = goals[control.key]
                    next_duty(control.state, measured[control.key], control.goal, self.gains)
                    if control.goal is None or control.state.duty >= FULL_DUTY:
                        self._release(control)
                    elif self._ensure_target(control):
                        held.append(control)
                        self._mark(control, True)
        return throttled

    def _note_stale(self, gpu: int, reason: str | None) -> str | None:
        """Log when a GPU's readings go stale and when they come back."""
        if reason is not None and gpu not in self._stale:
            log.warning("GPU %d: readings are stale (%s): its containers run unthrottled", gpu, reason)
            self._stale[gpu] = reason
        elif reason is None and gpu in self._stale:
            log.warning("GPU %d: readings are back (were: %s): caps held again", gpu, self._stale.pop(gpu))
        return reason

    def _measure(self, gpu: int, key: str) -> Measurement | None:
        schedule = self._cycles[gpu]
        return self.meter.measure(gpu, key, schedule.length, schedule.phase, schedule.since_s)

    def _control_of(self, key: str, spec: EnforcementSpec) -> ContainerControl:
        control = self._controls.get(key)
        if control is None:
            # Not throttled until measured above its target: a container starting up (or
            # doing CPU work only) must not be frozen for GPU use it does not have.
            control = self._controls[key] = ContainerControl(spec, key, DutyState())
        control.spec = spec
        return control

    def _ensure_target(self, control: ContainerControl) -> bool:
        if control.target is None:
            try:
                control.target = self._locate(control.spec)
            except VcudaError as err:
                control.problem = str(err)
            if control.target is None:
                control.problem = control.problem or NOT_FOUND
                return False
            if control.problem == NOT_FOUND:
                control.problem = ""
        return True

    # Acting -----------------------------------------------------------------------------------
    def _freeze(self, control: ContainerControl) -> None:
        target = control.target
        assert target is not None
        try:
            self.actuator.freeze(target)
        except VcudaError as err:
            self._undo_freeze(control, target)
            self._actuator_failed(control, "freeze", err)
            return
        if control.problem:
            log.warning("%s: frozen again (the last problem was: %s)", control.spec.label, control.problem)
            control.problem = ""
        control.frozen, control.frozen_at = True, self._clock.monotonic()
        control.freezes += 1

    def _undo_freeze(self, control: ContainerControl, target: ThrottleTarget) -> None:
        """A failed freeze may have paused part of the container (signals: processes stopped
        before a journal write failed): nothing the loop does not count as frozen stays so."""
        try:
            self.actuator.thaw(target)
        except VcudaError as err:  # what it paused is in the journal: the watchdog's backstop
            log.error("%s: undoing a failed freeze failed: %s", control.spec.label, err)

    def _thaw(self, control: ContainerControl) -> None:
        if not control.frozen or control.target is None:
            return
        try:
            self.actuator.thaw(control.target)
        except VcudaError as err:
            # Still frozen as far as we know: keep the target so the next period (or
            # release_all, or the watchdog from the journal) tries again.
            self.stats.actuator_errors += 1
            control.problem = f"thaw failed: {err}"
            log.error("%s: thaw failed, will retry: %s", control.spec.label, err)
            return
        control.frozen = False
        control.frozen_s += self._clock.monotonic() - control.frozen_at

    def _mark(self, control: ContainerControl, throttled: bool) -> None:
        if control.throttled == throttled:
            return
        control.throttled = throttled
        if throttled:
            action = "throttled"
            detail = (
                f"{control.spec.policy}: using {control.used:.0f}% against a target of "
                f"{control.goal or 0:.0f}%; duty {control.state.duty:.2f}"
            )
        else:
            action, detail = "released", f"using {control.used:.0f}%, no longer held"
        for listener in self.on_action:
            listener(control.spec.label, action, detail)

    def _release(self, control: ContainerControl) -> None:
        """Not throttled any more: thawed, and forgotten by the actuator (and its journal)."""
        self._mark(control, False)
        self._thaw(control)
        if control.target is not None:
            try:
                self.actuator.release(control.target)
            except VcudaError as err:
                self._actuator_failed(control, "release", err)
            else:
                control.problem = ""

    def _drop(self, control: ContainerControl) -> None:
        self._release(control)
        for gpu in control.spec.gpus:
            self.meter.forget(gpu, control.key)

    def release_all(self) -> None:
        """Thaw everything (stop, or the loop died)."""
        with self._lock:
            for control in self._controls.values():
                self._thaw(control)
        try:
            self.actuator.release_all()
        except VcudaError as err:
            log.error("could not thaw every container: %s", err)

    def _actuator_failed(self, control: ContainerControl, what: str, err: VcudaError) -> None:
        self.stats.actuator_errors += 1
        problem = f"{what} failed: {err}"
        # Once per episode: a freeze the journal refuses is retried every period.
        level = logging.DEBUG if problem == control.problem else logging.WARNING
        if isinstance(err, JournalError) and what == "freeze":
            log.log(
                level,
                "%s: not frozen: %s; it runs unthrottled until the journal can be written",
                control.spec.label,
                err,
            )
        else:
            log.log(level, "%s: %s failed: %s", control.spec.label, what, err)
        control.problem = problem
        control.target = None  # looked up again next period (the container may have restarted)

    def _report(self, gpu: int, message: str) -> None:
        if (gpu, message) not in self._reported:
            self._reported.add((gpu, message))
            log.warning("%s", message)

    # Reading ----------------------------------------------------------------------------------
    def controls(self) -> list[ContainerControl]:
        with self._lock:
            return list(self._controls.values())

    def measured(self, control: ContainerControl) -> bool:
        """Whether NVML ever credited the container with a sample (its ``used`` is measured,
        not merely 0: under MPS, NVML may credit every client's work to the MPS server)."""
        gpus = control.spec.gpus
        estimator = self.meter.estimators.get(gpus[0]) if gpus else None
        return estimator is not None and estimator.has_samples(control.key)

    def gpu_views(self) -> dict[int, GpuView]:
        with self._lock:
            return dict(self._views)
