"""The compute-cap loop: measure each GPU container's use, decide whom to hold, act.

Each control period (``period_s``), in one thread, for each GPU:

1. read its new samples: device samples attributed through the agent's own record of whom
   it kept thawed when (:mod:`agent.control.turnmeter`; GPUs held by *turns*, the default),
   or NVML's per-process samples (:mod:`agent.control.dutyloop`; *duty cycles*, for GPUs
   under MPS, drivers without device samples, and ``--control-feedback nvml``);
2. set each container's target by policy and decide whom to hold
   (:mod:`agent.control.turnloop` / :mod:`agent.domain.dutycontrol`);
3. thaw and freeze at the times the turns or the duty cycles ask for, earliest first, until
   the next period.

A GPU whose readings are stale (a backend call stuck, reads failing) has all its containers
released (thawed, not held) until readings come back: the loop never holds a container on
figures it does not have. A freeze that fails (the freeze journal cannot be written, the
freezer refused) is skipped and undone: nothing stays paused that the journal may not list.
The actuator (freezer or signals) is behind :class:`~agent.control.actuators.Actuator`;
this loop does not know which. When the loop ends, for any reason, everything it froze is
thawed. Time comes from a :class:`~agent.clock.Clock`, so tests drive it virtually.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from agent.clock import Clock, SystemClock
from agent.control.actuators import Actuator, ThrottleTarget
from agent.control.containers import ContainerControl, EnforcerStats, GpuView
from agent.control.dutyloop import DutyLoop
from agent.control.strategy import GpuStrategy
from agent.control.turnloop import TurnLoop
from agent.control.turnmeter import TurnMeter
from agent.control.usagemeter import SampleSource, container_key
from agent.domain.dutycontrol import DutyState, Gains
from agent.domain.specs import EnforcementSpec
from agent.domain.turns import TurnSettings
from agent.errors import VcudaError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.freezejournal import JournalError

log = logging.getLogger(__name__)

NOT_FOUND = "the container's cgroup was not found (yet)"
FEEDBACKS = ("device", "nvml")  # turns on device samples (default), or duty cycles on NVML's samples


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
        period_s: float = Gains.period_s,
        gains: Gains | None = None,
        turns: TurnSettings | None = None,
        feedback: str = "device",
        concurrent: Callable[[int], bool] = lambda _gpu: False,
        idle_read_s: float = 1.0,
        untrusted: Callable[[EnforcementSpec], float | None] = lambda _spec: None,
        clock: Clock | None = None,
        enabled: bool = True,
    ) -> None:
        """``feedback``: "device" (turns wherever the GPU time-slices) or "nvml" (duty cycles
        everywhere); ``concurrent``: whether a GPU's clients run concurrently now (MPS),
        where turns do not apply; ``idle_read_s``: a GPU with no container under control is
        read this often (not every period); ``untrusted(spec)``: the share (percent) the freezer holds a
        container to whose MPS limits are not trusted (None: they are, or it has none)."""
        self._gpus = tuple(gpus)
        self._specs = specs
        self._locate = locate
        self.actuator = actuator
        self.period_s = period_s
        self.idle_read_s = idle_read_s
        self.gains = gains or Gains(period_s=period_s)
        self.feedback = feedback
        self._concurrent = concurrent
        self._clock = clock or SystemClock()
        self.enabled = enabled
        self.duty = DutyLoop(
            self._gpus,
            samples,
            owner_of,
            gains=self.gains,
            clock=self._clock,
            report=self._report,
            blind=untrusted,
            slot_s=(turns or TurnSettings()).slot_s,
        )
        turn_settings = turns or TurnSettings()
        self.turns = TurnLoop(
            self._gpus,
            TurnMeter(
                self._gpus, samples, owner_of, settings=turn_settings, clock=self._clock, report=self._report
            ),
            settings=turn_settings,
            clock_now=self._clock.monotonic,
            idle_hold_s=self.gains.idle_hold_s,
            period_s=period_s,
            view_window_s=self.gains.window_s,
        )
        self._strategies: tuple[GpuStrategy, ...] = (self.duty, self.turns)  # due: in this order
        self._holders: dict[int, GpuStrategy] = {}  # which strategy held each GPU last period
        self._controls: dict[str, ContainerControl] = {}
        self._views: dict[int, GpuView] = {}
        self._lock = threading.Lock()
        self._reported: set[tuple[int, str]] = set()
        self._stale: dict[int, str] = {}  # GPUs whose containers are released, and why
        self.stats = EnforcerStats()
        # (container label, action, detail) when a container starts or stops being throttled
        self.on_action: list[Callable[[str, str, str], object]] = []
        # (spec, why) once when a held container's cap turns out not holdable by freezing
        self.on_unholdable: list[Callable[[EnforcementSpec, str], object]] = []

    def strategy(self, gpu: int) -> GpuStrategy:
        """What holds the GPU's containers this period."""
        return self.turns if self.uses_turns(gpu) else self.duty

    def uses_turns(self, gpu: int) -> bool:
        """Whether the GPU is held by turns (else by duty cycles on NVML's samples)."""
        return (
            self.feedback == "device"
            and not self._concurrent(gpu)
            and not self.turns.meter.gpus[gpu].unsupported
        )

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
        chosen = {g: self.strategy(g) for g in self._gpus}
        for gpu, strategy in chosen.items():
            previous = self._holders.get(gpu, strategy)
            if previous is not strategy:
                log.info("GPU %d: now held by %s (was %s)", gpu, strategy.name, previous.name)
                previous.reset(gpu)  # nothing of the old one's is due there any more
                strategy.take_over(gpu)
        self._holders = chosen
        # A GPU with no container under control is read once a second (for its status), not
        # every period, where turns hold it: an idle node costs next to nothing.
        # A crowded GPU (turns in a stretched cycle) is read and decided once in a few periods
        # (TurnLoop.read_every), staggered by GPU; its turns go on between.
        occupied = {c.spec.gpus[0] for c in self._controls.values() if c.spec.gpus}
        every = max(1, round(self.idle_read_s / self.period_s))
        due = {g for g in self._gpus if (index + g) % chosen[g].read_every(g) == 0}
        for strategy in self._strategies:
            gpus = [g for g in self._gpus if chosen[g] is strategy and g in due]
            if strategy is self.turns:
                gpus = [g for g in gpus if g in occupied or index % every == 0]
            strategy.read(gpus, index, start)
        self.stats.measure_errors = sum(s.errors for s in self._strategies)
        held = self._control(chosen, due)
        self.stats.periods += 1
        self.stats.observe(self._clock.monotonic() - work_start)
        if not self.enabled:
            return
        for gpu, on_gpu in held.items():
            chosen[gpu].schedule(gpu, on_gpu, index, start)
        self._act(start + self.period_s, stop)

    def _act(self, until: float, stop: threading.Event | None) -> None:
        """Run the strategies' freezes and thaws until ``until``, earliest first."""
        while True:
            next_at = min([until, *(s.next_time() for s in self._strategies)])
            if next_at >= until:
                return
            wait = next_at - self._clock.monotonic()
            if wait > 0 and self._clock.sleep(wait, stop):
                return  # stopping: run()'s finally thaws
            # Everything due within the next slot goes in this wake-up.
            now = self._clock.monotonic()
            with self._lock:
                for strategy in self._strategies:
                    for gpu, control, thaw in strategy.due(now):
                        if thaw:
                            self._thaw(control, gpu)
                        elif not control.frozen and (control.throttled or control.yielding):
                            self._freeze(control, gpu)

    # Controlling ------------------------------------------------------------------------------
    def _control(self, chosen: dict[int, GpuStrategy], due: set[int]) -> dict[int, list[ContainerControl]]:
        """Targets and whom to hold, per GPU by its strategy (the GPUs ``due`` this period);
        returns the held containers the actuator can act on, per GPU decided."""
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
                strategy = chosen[gpu]
                if gpu not in due and all(key in self._controls for key in on_gpu):
                    continue  # decided at its next read (a new container: now)
                stale = self._note_stale(gpu, strategy.stale(gpu))
                controls = [self._control_of(key, spec) for key, spec in on_gpu.items()]
                self._views[gpu] = strategy.view(gpu, stale, controls)
                if stale is not None:
                    for control in controls:  # fail safe: thawed and left alone
                        control.goal = None
                        self._release(control, gpu)
                    for each in self._strategies:
                        each.reset(gpu)
                    throttled[gpu] = []
                    continue
                acting = {c.key for c in strategy.update(gpu, controls)}
                strategy_held = strategy.held(gpu)
                held = throttled[gpu] = []
                for control in controls:
                    if control.key in acting and self._ensure_target(control):
                        if control.key not in strategy_held:  # yields to the held ones' turns
                            self._mark(control, False)
                            continue
                        held.append(control)
                        self._mark(control, True)
                    else:
                        self._release(control, gpu)
                    self._tell_unholdable(control)
        return throttled

    def _tell_unholdable(self, control: ContainerControl) -> None:
        """Once per episode: the cap of a held container cannot be held by freezing."""
        if control.unholdable and control.throttled and not control.told_unholdable:
            control.told_unholdable = True
            log.warning("%s: its cap cannot be held by freezing: %s", control.spec.label, control.unholdable)
            for listener in self.on_action:
                listener(control.spec.label, "unholdable", control.unholdable)
            for tell in self.on_unholdable:
                tell(control.spec, control.unholdable)
        elif not control.unholdable:
            control.told_unholdable = False

    def _note_stale(self, gpu: int, reason: str | None) -> str | None:
        """Log when a GPU's readings go stale and when they come back."""
        if reason is not None and gpu not in self._stale:
            log.warning("GPU %d: readings are stale (%s): its containers run unthrottled", gpu, reason)
            self._stale[gpu] = reason
        elif reason is None and gpu in self._stale:
            log.warning("GPU %d: readings are back (were: %s): caps held again", gpu, self._stale.pop(gpu))
        return reason

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
    def _freeze(self, control: ContainerControl, gpu: int | None = None) -> None:
        """``gpu``: where turns run, the attribution is told (it replays what the loop did)."""
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
        self._acted(control, False, gpu)

    def _undo_freeze(self, control: ContainerControl, target: ThrottleTarget) -> None:
        """A failed freeze may have paused part of the container (signals: processes stopped
        before a journal write failed): nothing the loop does not count as frozen stays so."""
        try:
            self.actuator.thaw(target)
        except VcudaError as err:  # what it paused is in the journal: the watchdog's backstop
            log.error("%s: undoing a failed freeze failed: %s", control.spec.label, err)

    def _thaw(self, control: ContainerControl, gpu: int | None = None) -> None:
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
        self._acted(control, True, gpu)

    def _acted(self, control: ContainerControl, thawed: bool, gpu: int | None) -> None:
        if gpu is None and control.spec.gpus:
            gpu = control.spec.gpus[0]
        if gpu is not None and gpu in self._gpus:
            at = self._clock.monotonic()
            for strategy in self._strategies:
                strategy.acted(gpu, control, thawed, at)

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

    def _release(self, control: ContainerControl, gpu: int | None = None) -> None:
        """Not throttled any more: thawed, and forgotten by the actuator (and its journal)."""
        self._mark(control, False)
        control.yielding = False
        self._thaw(control, gpu)
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
            if gpu in self._gpus:
                for strategy in self._strategies:
                    strategy.forget(gpu, control.key)

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
        """Whether the container's ``used`` is measured, not merely 0: turns measure every
        container of a GPU with device samples; duty cycles only those NVML ever credited
        (under MPS, NVML may credit every client's work to the MPS server)."""
        gpus = control.spec.gpus
        if not gpus or gpus[0] not in self._gpus:
            return False
        return self.strategy(gpus[0]).measured(gpus[0], control.key)

    def gpu_views(self) -> dict[int, GpuView]:
        with self._lock:
            return dict(self._views)
