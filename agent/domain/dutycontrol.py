"""The duty-cycle control law: targets by policy, and the next duty from the measured use.

A throttled container runs (is thawed) for ``duty`` of each control period and is frozen
for the rest, so its utilization is about ``duty x`` what it would use unthrottled. Per
GPU, each period:

1. **Targets** by policy: fixed-share → its cap; burst-share → its ceiling
   (``vcuda-core-limit``, or 100) while no other container on the GPU is active, its
   request as soon as one is (the neighbours get their share back); best-effort and whole
   GPUs → no target (never throttled).
2. **Duty**: an integral controller, ``duty += gain x (target - used) / 100``, clamped to
   ``[min_duty, 1]`` (clamping is the anti-windup: a container using less than its target
   at duty 1 stays at 1). When the use is far above the target (a burst-share container
   brought back to its request, a workload that turned busy after idling at duty 1) one
   proportional jump ``duty x target / used`` gets there at once; jumps are at most one
   per measurement window (plus the samples' lag), because the window still shows the old
   use for that long.
3. **Lag**: NVML's per-process samples can be seconds old. An integrator that keeps
   pushing while its last pushes are not yet visible oscillates, so the gain is scaled by
   ``(reference lag / measured lag)²`` once the lag (samples' age + half the window)
   exceeds what the window alone causes; and a period with no new sample changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.domain.annotations import Policy

K = TypeVar("K", bound=Hashable)

ACTIVE_PERCENT = 5.0  # a container using this much of the GPU wants its share
JUMP_MARGIN_PERCENT = 10.0  # used above target by more than this: jump rather than integrate


@dataclass(frozen=True)
class Member(Generic[K]):
    """One container on one GPU, as the control law sees it."""

    key: K
    policy: Policy
    request: int  # vcuda-core
    cap: int | None  # None: whole GPU
    ceiling: int | None  # the most it may use; None: never throttled
    used: float  # measured, percent of the GPU


def targets(members: Sequence[Member[K]]) -> dict[K, float | None]:
    """Target utilization per container (None: not throttled)."""
    active = {m.key for m in members if m.used >= ACTIVE_PERCENT}
    out: dict[K, float | None] = {}
    for m in members:
        if m.ceiling is None:
            out[m.key] = None
        elif m.policy is Policy.BURST_SHARE:
            contended = any(k != m.key for k in active)
            out[m.key] = float(m.request if contended else m.ceiling)
        else:
            out[m.key] = float(m.ceiling)
    return out


@dataclass
class DutyState:
    """The controller's memory for one container."""

    duty: float = 1.0
    last_jump_s: float = float("-inf")


@dataclass(frozen=True)
class Gains:
    gain: float = 0.5
    min_duty: float = 0.02
    window_s: float = 1.0
    period_s: float = 0.25

    @property
    def reference_lag_s(self) -> float:
        """The lag the window alone causes (its centre), plus one period of sampling."""
        return self.window_s / 2 + self.period_s

    def scaled(self, lag_s: float) -> float:
        if lag_s <= self.reference_lag_s:
            return self.gain
        return self.gain * (self.reference_lag_s / lag_s) ** 2


def next_duty(
    state: DutyState, used: float, target: float | None, now_s: float, gains: Gains, *, age_s: float = 0.0
) -> float:
    """Update ``state`` for one period with a fresh measurement ``age_s`` old (its newest
    sample's age) and return the new duty (1.0: not throttled)."""
    if target is None:
        state.duty = 1.0
        return 1.0
    error = target - used
    hold_s = gains.window_s + age_s  # a jump shows fully in the measurement after this long
    if now_s - state.last_jump_s >= hold_s:
        if -error > JUMP_MARGIN_PERCENT and used > 0:
            state.duty = state.duty * target / used
            state.last_jump_s = now_s
        else:
            state.duty += gains.scaled(gains.window_s / 2 + age_s) * error / 100.0
    state.duty = min(1.0, max(gains.min_duty, state.duty))
    return state.duty
