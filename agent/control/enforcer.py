"""The compute-cap loop: measure each GPU container's use, set its duty, run the duty cycle.

Each control period (``period_s``), in one thread:

1. thaw every container frozen in the previous period (so nothing stays frozen longer than
   one period in a row, and measuring never happens while a container is held);
2. read each GPU's new per-process samples and device utilization, map pids to
   containers, update the estimators (:mod:`agent.domain.usage`);
3. compute targets and duties (:mod:`agent.domain.dutycontrol`) from the specs;
4. freeze each throttled container at ``start + duty x period``, shortest duty first.

The actuator (freezer or signals) is behind :class:`~agent.control.actuators.Actuator`;
this loop does not know which. When the loop ends, for any reason, everything it froze is
thawed. Time comes from a :class:`~agent.clock.Clock`, so tests drive it virtually.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.clock import Clock, SystemClock
from agent.control.actuators import Actuator, ThrottleTarget
from agent.domain.dutycontrol import ACTIVE_PERCENT, DutyState, Gains, Member, next_duty, targets
from agent.domain.specs import EnforcementSpec
from agent.domain.usage import GpuUsageEstimator
from agent.errors import VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import ProcessSample

log = logging.getLogger(__name__)

FULL_DUTY = 0.98  # above this, freezing for a few ms is not worth two writes
FREEZE_SLOT_S = 0.004  # freezes due this close together share one wake-up
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class SampleSource(Protocol):
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]: ...

    def device_utilization(self, index: int) -> int: ...


def container_key(pod_uid: str, container_id: str) -> str:
    """The loop's key for a container: a string, whose hash Python caches (a dataclass's
    is recomputed on every lookup, and the loop does thousands per period)."""
    return f"{pod_uid}/{container_id}"


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


@dataclass(frozen=True)
class GpuView:
    index: int
    device_percent: float | None
    source: str


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
        self._samples = samples
        self._specs = specs
        self._owner_of = owner_of
        self._locate = locate
        self.actuator = actuator
        self.period_s = period_s
        self.gains = gains or Gains(period_s=period_s)
        self._clock = clock or SystemClock()
        self.enabled = enabled
        self._estimators = {g: GpuUsageEstimator[str](self.gains.window_s) for g in self._gpus}
        self._since = dict.fromkeys(self._gpus, 0)
        self._seen_us: dict[int, int | None] = {}
        self._controls: dict[str, ContainerControl] = {}
        self._views: dict[int, GpuView] = {}
        self._lock = threading.Lock()
        self._reported: set[tuple[int, str]] = set()
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
        self._thaw_all_frozen()
        self._measure()
        throttled = self._control(start)
        self.stats.periods += 1
        self.stats.observe(self._clock.monotonic() - work_start)
        if not self.enabled:
            return
        pending = sorted(throttled, key=lambda c: c.state.duty)
        i = 0
        while i < len(pending):
            wait = start + pending[i].state.duty * self.period_s - self._clock.monotonic()
            if wait > 0 and self._clock.sleep(wait, stop):
                return  # stopping: run()'s finally thaws
            # Everything due within the next slot goes in this wake-up: one wake-up per
            # distinct duty, not per container.
            due = self._clock.monotonic() + FREEZE_SLOT_S
            while i < len(pending) and start + pending[i].state.duty * self.period_s <= due:
                self._freeze(pending[i])
                i += 1

    # Measuring --------------------------------------------------------------------------------
    def _measure(self) -> None:
        owners: dict[int, str | None] = {}
        now = self._clock.monotonic()
        for gpu in self._gpus:
            estimator = self._estimators[gpu]
            try:
                samples = self._samples.process_samples(gpu, self._since[gpu])
                device = self._samples.device_utilization(gpu)
            except VcudaError as err:
                self.stats.measure_errors += 1
                self._report(gpu, f"cannot read GPU {gpu} utilization: {err}")
                continue
            if samples:
                self._since[gpu] = max(self._since[gpu], *(s.timestamp_us for s in samples))
            rows = []
            for s in samples:
                if s.pid not in owners:
                    owners[s.pid] = self._owner(s.pid)
                rows.append((owners[s.pid], s.timestamp_us, float(s.sm_util)))
            estimator.add_samples(rows)
            estimator.add_device(now, float(device))

    def _owner(self, pid: int) -> str | None:
        try:
            ref = self._owner_of(pid)
        except VcudaError as err:
            log.debug("pid %d: %s", pid, err)
            return None
        return None if ref is None else container_key(ref.pod_uid, ref.container_id)

    # Controlling ------------------------------------------------------------------------------
    def _control(self, start: float) -> list[ContainerControl]:
        by_gpu: dict[int, dict[str, EnforcementSpec]] = {gpu: {} for gpu in self._gpus}
        for spec in self._specs():
            if spec.container_id and spec.gpus and spec.gpus[0] in by_gpu:
                by_gpu[spec.gpus[0]][container_key(spec.pod_uid, spec.container_id)] = spec
        wall = self._clock.wall()
        throttled: list[ContainerControl] = []
        with self._lock:
            current = {key for specs in by_gpu.values() for key in specs}
            for key in self._controls.keys() - current:
                self._drop(self._controls.pop(key))
            for gpu, on_gpu in by_gpu.items():
                estimator = self._estimators[gpu]
                estimate = estimator.estimate(wall)
                self._views[gpu] = GpuView(gpu, estimator.device_mean(), estimate.source)
                members = [
                    self._member(key, spec, estimate.by_key.get(key, 0.0)) for key, spec in on_gpu.items()
                ]
                goals = targets(members)
                # New samples, or a GPU nobody is using (no samples come then: the containers'
                # zero use is news too, or an idle container would stay throttled).
                device = estimator.device_mean()
                idle = device is not None and device < ACTIVE_PERCENT
                fresh = estimator.newest_us != self._seen_us.get(gpu) or idle
                self._seen_us[gpu] = estimator.newest_us
                age = estimate.newest_sample_age_s or 0.0
                for key, spec in on_gpu.items():
                    control = self._controls[key]
                    control.spec = spec
                    control.goal = goals[key]
                    if fresh or control.goal is None:  # no new sample: nothing new to act on
                        next_duty(control.state, control.used, control.goal, start, self.gains, age_s=age)
                    if control.goal is None or control.state.duty >= FULL_DUTY:
                        self._release(control)
                    elif self._ensure_target(control):
                        throttled.append(control)
                        self._mark(control, True)
        return throttled

    def _member(self, key: str, spec: EnforcementSpec, used: float) -> Member[str]:
        control = self._controls.get(key)
        if control is None:
            # Not throttled until measured above its target: a container starting up (or
            # doing CPU work only) must not be frozen for GPU use it does not have.
            control = self._controls[key] = ContainerControl(spec, key, DutyState())
        control.used = used
        return Member(key, spec.policy, spec.cores, spec.cap, spec.ceiling, used)

    def _ensure_target(self, control: ContainerControl) -> bool:
        if control.target is None:
            try:
                control.target = self._locate(control.spec)
            except VcudaError as err:
                control.problem = str(err)
            if control.target is None:
                control.problem = control.problem or "the container's cgroup was not found (yet)"
                return False
        return True

    # Acting -----------------------------------------------------------------------------------
    def _freeze(self, control: ContainerControl) -> None:
        assert control.target is not None
        try:
            self.actuator.freeze(control.target)
        except VcudaError as err:
            self._actuator_failed(control, "freeze", err)
            return
        control.frozen, control.frozen_at = True, self._clock.monotonic()
        control.freezes += 1

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

    def _thaw_all_frozen(self) -> None:
        with self._lock:
            for control in self._controls.values():
                self._thaw(control)

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

    def _drop(self, control: ContainerControl) -> None:
        self._release(control)
        for gpu in control.spec.gpus:
            if gpu in self._estimators:
                self._estimators[gpu].forget(control.key)

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
        control.problem = f"{what} failed: {err}"
        control.target = None  # looked up again next period (the container may have restarted)
        log.warning("%s: %s failed: %s", control.spec.label, what, err)

    def _report(self, gpu: int, message: str) -> None:
        if (gpu, message) not in self._reported:
            self._reported.add((gpu, message))
            log.warning("%s", message)

    # Reading ----------------------------------------------------------------------------------
    def controls(self) -> list[ContainerControl]:
        with self._lock:
            return list(self._controls.values())

    def gpu_views(self) -> dict[int, GpuView]:
        with self._lock:
            return dict(self._views)
