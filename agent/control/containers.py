"""What the compute-cap loop knows about each GPU container and each GPU: also what status
and the metrics show."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.control.actuators import ThrottleTarget
from agent.domain.dutycontrol import DutyState
from agent.domain.specs import EnforcementSpec

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
    cycle_s: float = 0.0  # its GPU's duty cycle (turns: the mean time between its turns) while held
    yielding: bool = False  # not held, but frozen during held containers' turns (turns)
    unholdable: str = ""  # why its cap cannot be held by freezing (turns), for status and an Event
    told_unholdable: bool = False  # the listeners heard of this episode
    held_blind: bool = False  # held to a fixed duty: an MPS client whose limits are not trusted


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
