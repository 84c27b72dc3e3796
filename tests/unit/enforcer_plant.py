"""The enforcer's loop against simulated GPUs in virtual time (agent.emulators.virtualgpu)."""

from __future__ import annotations

import bisect
from collections.abc import Callable

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.containers import ContainerControl
from agent.control.enforcer import Enforcer
from agent.domain.annotations import Policy
from agent.domain.dutycontrol import Gains
from agent.domain.specs import EnforcementSpec
from agent.domain.turns import TurnSettings
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

PERIOD = 0.25


def spec(
    name: str,
    cores: int,
    policy: Policy = Policy.FIXED_SHARE,
    cap: int | None = None,
    limit_set: bool = False,
) -> EnforcementSpec:
    whole = cores >= 100
    return EnforcementSpec(
        pod_uid=f"uid-{name}",
        namespace="default",
        pod=name,
        container="c",
        container_id=f"cid-{name}",
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=cores,
        cap=None if whole else (cap if cap is not None else cores),
        memory_quota_mib=None if whole else 1024,
        policy=policy,
        limit_set=limit_set,
    )


class Rig:
    """One simulated GPU, its containers' programs and an enforcer, all in virtual time."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        gains: Gains | None = None,
        feedback: str = "device",
        untrusted: Callable[[EnforcementSpec], float | None] = lambda _spec: None,
        uncredited: frozenset[str] = frozenset(),
        *,
        concurrent: Callable[[int], bool] = lambda _gpu: False,
        turns: TurnSettings | None = None,
    ) -> None:
        """``feedback``: "device" (turns, the default) or "nvml" (the legacy duty cycles);
        ``untrusted``: the enforcer's (MPS limits not trusted); ``uncredited``: the containers
        whose samples no container owns (NVML credits an MPS client's work to the server);
        ``concurrent``: the enforcer's (whether the GPU's clients run concurrently now);
        ``turns``: the enforcer's turn settings (None: the defaults)."""
        self.clock = VirtualClock()
        self._hidden = uncredited
        self.gpu = VirtualGpuNode(self.clock, [config or EngineConfig()])
        self.specs: list[EnforcementSpec] = []
        self.stats: dict[str, WorkloadStats] = {}
        self._gains, self._feedback, self._untrusted = gains, feedback, untrusted
        self._concurrent = concurrent
        self._turns = turns
        self.enforcer = self._new_enforcer()
        self.start = self.clock.monotonic()
        self._times: list[float] = []
        self._ran: list[dict[str, float]] = []
        self.actions: list[tuple[str, str, str]] = []
        self.enforcer.on_action.append(lambda *action: self.actions.append(action))

    def _new_enforcer(self) -> Enforcer:
        return Enforcer(
            gpus=[0],
            samples=self.gpu,
            specs=lambda: self.specs,
            owner_of=self._owner_of,
            locate=lambda s: ThrottleTarget(s.container_id, None, None),
            actuator=self.gpu,
            period_s=PERIOD,
            gains=self._gains,
            feedback=self._feedback,
            untrusted=self._untrusted,
            concurrent=self._concurrent,
            clock=self.clock,
            turns=self._turns,
        )

    def restart(self, down_s: float) -> None:
        """The agent SIGKILLed and started again: the watchdog thaws everything at once, the
        containers run unthrottled for ``down_s``, then a new enforcer starts from nothing
        (no turns, drains or accounts of the old one)."""
        self.gpu.release_all()
        end = self.clock.monotonic() + down_s
        while self.clock.monotonic() < end - 1e-9:
            self.clock.sleep(min(PERIOD, end - self.clock.monotonic()))
            self._record()
        self.enforcer = self._new_enforcer()
        self.enforcer.on_action.append(lambda *action: self.actions.append(action))

    def add(self, name: str, pattern: PatternSpec, item: EnforcementSpec) -> None:
        self.stats[name] = WorkloadStats()
        self.gpu.add(name, 0, pattern_program(pattern, self.stats[name]))
        self.specs.append(item)

    def _owner_of(self, pid: int) -> ContainerRef | None:
        ref = self.gpu.owner_of(pid)
        return None if ref is None or ref.container_id.removeprefix("cid-") in self._hidden else ref

    def run_for(self, seconds: float) -> None:
        end = self.clock.monotonic() + seconds
        while self.clock.monotonic() < end - 1e-9:
            self.enforcer.period()
            remaining = PERIOD - (self.clock.monotonic() - self.start) % PERIOD
            self.clock.sleep(remaining)
            self._record()

    def _record(self) -> None:
        self._times.append(self.clock.monotonic() - self.start)
        self._ran.append({name: self.gpu.gpu_seconds(name) for name in self.gpu.containers})

    def mean(self, name: str, after_s: float, seconds: float) -> float:
        """The container's real use (percent of the GPU) over [after_s, after_s + seconds]."""

        def ran_at(t: float) -> float:
            i = min(bisect.bisect_left(self._times, t - 1e-9), len(self._times) - 1)
            return self._ran[i].get(name, 0.0)

        return 100 * (ran_at(after_s + seconds) - ran_at(after_s)) / seconds

    def control(self, name: str) -> ContainerControl:
        return next(c for c in self.enforcer.controls() if c.spec.pod == name)
