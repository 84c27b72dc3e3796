"""The duty-cycle control law: targets by policy, the next duty from the measured use, and
how long a container's duty cycle must be for the work it leaves running when frozen.

A throttled container runs (is thawed) for ``duty`` of each cycle of its GPU and is frozen
for the rest (:mod:`agent.control.dutycycle`). Per container:

1. **Targets** by policy: fixed-share → its cap; burst-share → its ceiling
   (``vcuda-core-limit``, or 100) while no other container on the GPU is active, its
   request as soon as one is (the neighbours get their share back); best-effort and whole
   GPUs → no target (never throttled). A target of the whole GPU throttles nothing.
2. **Duty**, from each measurement over whole cycles that began after the last change
   (:mod:`agent.control.usagemeter`): ``duty x (1 + share x (target / used - 1))``, which
   corrects ``share`` of the relative error in one step. Far from the target (more than
   10 pp) ``share`` is 1 (a container that woke up at duty 1, a burst-share container
   brought back to its request, a neighbour that left or came); near it, ``gain`` scaled
   down in proportion below 5 pp, because work comes in units (kernels, steps) and a
   measurement a few points off is as likely noise as drift. A raise of more than a tenth
   waits for a second measurement that asks for it too: a stretch that caught the
   container going idle reads low, and a cap must hold through that. Waiting for a
   measurement wholly after the last change is what handles NVML's late samples: nothing
   is corrected twice for the same error, however late the samples are.
3. **Idle**: a throttled container that stops using the GPU keeps its duty (and cycle)
   for ``idle_hold_s``, so a workload that pauses between bursts comes back at the duty
   that held it, instead of running unthrottled until the late samples show it; idle
   longer than that, it is released. This holds even while its target is the whole GPU (a
   burst-share container whose neighbours paused with it): they come back together, held.
   A stretch that includes the idle time is not used.
4. **Cycle length**: a frozen process stops submitting, but the GPU finishes what it has
   queued (a training step, a graph, a deep queue). Work in flight at each freeze makes the
   use a staircase of the duty, one step per unit of work: with a cycle short against that
   unit, the use does not follow the duty at all. A newly throttled container's cycle is
   one measurement window; it doubles (up to ``max_cycle_s``) when the use stays over the
   target while the duty has come down by ``SLIDE`` without the use moving, or sits at the
   minimum. The share of each cycle the container ran while frozen is at least
   ``used - duty`` (it cannot run faster than the GPU while thawed): that lower bound of
   its drain is kept for status. A drain longer than the longest cycle (a queue of seconds
   of work refilled in every thawed slice) cannot be held by freezing at all: that
   container's duty sits at ``min_duty`` and its use above its target.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.domain.annotations import Policy

K = TypeVar("K", bound=Hashable)

ACTIVE_PERCENT = 5.0  # a container using this much of the GPU wants its share
JUMP_MARGIN_PERCENT = 10.0  # this far from the target, an update corrects all of the error
NOISE_PP = 5.0  # errors under this are corrected less, in proportion
MAX_RAISE = 1.1  # an unconfirmed update raises a duty by at most this factor...
MIN_RAISE = 0.02  # ...plus this
DRAIN_SMOOTHING = 0.3  # weight of each new drain estimate
SENSITIVE_PP = 2.0  # a change of use this large shows it follows the duty
OVER_PP = 1.0  # over its target by this much, a container must come down
SLIDE = 0.1  # duty given up without the use moving: the cycle is too short for its work
MIXED_SHARE = 4  # a sample period over a quarter of the stretch mixes in too much of the past
CLOCK_TOL_S = 1e-3  # a cycle start and a change read from two clocks: equal within this


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


@dataclass(frozen=True)
class Measurement:
    """A container's use over a stretch of sample time (wall clock, seconds)."""

    used: float  # percent of the GPU over [start_s, end_s]
    start_s: float
    end_s: float
    now_s: float  # when it was taken
    current: bool = False  # from the device's own reading now (idle GPU, stalled samples)
    cycles: int = 1  # the duty cycle (control periods) it was taken under
    sample_period_s: float = 0.0  # NVML's sample period behind it (0: not from samples)


@dataclass
class DutyState:
    """The controller's memory for one container."""

    duty: float = 1.0
    last_end_s: float = float("-inf")  # the newest measurement acted on
    updated_s: float = float("-inf")  # when the duty was last changed by a measurement
    cycles: int = 1  # the duty cycle it needs, in control periods (a power of two)
    drain_s: float | None = None  # GPU seconds it runs after each freeze, at least (status)
    cycle_set_s: float = float("-inf")
    idle_since_s: float | None = None
    idle_end_s: float = float("-inf")  # the end of the last stretch that read idle
    reference: tuple[float, float] | None = None  # (duty, used) when the use last moved
    raise_asked: bool = False  # the last update wanted a larger raise than it made


@dataclass(frozen=True)
class Gains:
    gain: float = 0.7  # the share of a measured error one update corrects
    min_duty: float = 0.02
    window_s: float = 1.0
    period_s: float = 0.25
    max_cycle_s: float = 2.0  # the longest duty cycle a container's work can earn it
    idle_hold_s: float = 5.0  # an idle throttled container keeps its duty this long

    @property
    def max_cycles(self) -> int:
        cycles = 1
        while cycles * 2 * self.period_s <= self.max_cycle_s + 1e-9:
            cycles *= 2
        return cycles

    @property
    def start_cycles(self) -> int:
        """A newly throttled container's cycle: the measurement window, in periods."""
        return min(self.max_cycles, max(1, round(self.window_s / self.period_s)))

    def window_for(self, cycles: int) -> float:
        """A container's measurement window: at least one whole duty cycle."""
        return max(self.window_s, cycles * self.period_s)


def idle_level(target: float) -> float:
    """Below this use a throttled container counts as idle (half a tiny cap, else 5 %)."""
    return min(ACTIVE_PERCENT, target / 2)


def next_duty(state: DutyState, measured: Measurement | None, target: float | None, gains: Gains) -> float:
    """Update ``state`` with a measurement and return the new duty (1.0: not throttled). A
    measurement no newer than the last one acted on changes nothing."""
    fresh = measured is not None and (measured.current or measured.end_s > state.last_end_s)
    if target is None or (target >= 100 and not _holding_idle(state, measured, fresh)):
        state.duty, state.idle_since_s = 1.0, None  # the whole GPU: nothing to hold
        return 1.0
    if measured is None or not fresh:
        return state.duty
    if not measured.current:
        state.last_end_s = measured.end_s
    used, now_s = measured.used, measured.now_s
    if state.duty < 1.0 and used < idle_level(target):
        if state.idle_since_s is None:
            state.idle_since_s = now_s
        state.idle_end_s = measured.end_s
        if now_s - state.idle_since_s >= gains.idle_hold_s:
            state.duty, state.idle_since_s = 1.0, None
        return state.duty
    state.idle_since_s = None
    if measured.start_s < _valid_from(state, measured) or used <= 0:
        # The stretch still shows the use from before the last change of duty, or the idle
        # time before the container came back (it would read as spare share): wait.
        return state.duty
    if state.duty >= 1.0 and used <= target:
        return state.duty  # unthrottled and within its target: nothing to do
    before = state.duty
    if before >= 1.0 and state.drain_s is None:
        # Newly throttled: a cycle of one window, until its drain shows what it needs.
        state.cycles, state.cycle_set_s = gains.start_cycles, now_s
    error = abs(target - used)
    # Far off: all of the error at once. Near the target, less of it the smaller it is: a
    # measurement a few points off is as likely noise (work comes in units) as a drift.
    share = 1.0 if error > JUMP_MARGIN_PERCENT else gains.gain * min(1.0, error / NOISE_PP)
    duty = before * (1 + share * (target / used - 1))
    # A large raise only when a second stretch asks for it too: one that caught the
    # container going idle reads low, and the cap must hold through that.
    bounded = before * MAX_RAISE + MIN_RAISE
    if duty > bounded and not state.raise_asked:
        duty, state.raise_asked = bounded, True
    else:
        state.raise_asked = False
    state.duty = min(1.0, max(gains.min_duty, duty))
    state.updated_s = now_s
    _update_cycle(state, measured, target, before, gains)
    return state.duty


def _valid_from(state: DutyState, measured: Measurement) -> float:
    """The earliest start of a stretch that shows the current duty: after the last change
    (or the idle time before the container came back). A sample covers the sample period
    before its stamp, so the first one after a change still mixes in the time before it:
    where that period is a large share of the stretch, the stretch must begin a period later."""
    since = max(state.updated_s, state.idle_end_s)
    if measured.sample_period_s * MIXED_SHARE > measured.end_s - measured.start_s:
        since += measured.sample_period_s
    return since - CLOCK_TOL_S


def _holding_idle(state: DutyState, measured: Measurement | None, fresh: bool) -> bool:
    """A throttled container that is idle, or back from idle but measured over a stretch
    that still holds its pause, keeps its duty even when its target is the whole GPU
    meanwhile (a burst-share container whose neighbours paused with it): when they all come
    back, they come back held, whichever the late samples show back first."""
    if state.duty >= 1.0:
        return False
    if measured is None or not fresh:
        return state.idle_since_s is not None or state.idle_end_s > state.updated_s
    return measured.used < ACTIVE_PERCENT or measured.start_s < state.idle_end_s


def _update_cycle(state: DutyState, measured: Measurement, target: float, duty: float, gains: Gains) -> None:
    """From a measurement taken wholly under the current cycle (at ``duty``): the drain
    estimate, and a longer cycle when the use does not follow the duty at all (it stays
    over the target while the duty slides down by ``SLIDE``, or sits at the minimum): one
    unit of work per thawed slice then, whatever the slice, and a longer cycle makes each
    unit a smaller share of it."""
    if duty >= 1.0 or measured.start_s < state.cycle_set_s:
        return
    used = measured.used
    drain = max(0.0, used / 100 - duty) * measured.cycles * gains.period_s
    state.drain_s = (
        drain if state.drain_s is None else state.drain_s + DRAIN_SMOOTHING * (drain - state.drain_s)
    )
    if state.reference is None or abs(used - state.reference[1]) > SENSITIVE_PP:
        state.reference = (duty, used)  # the use moved: it follows the duty
    over = used > target + OVER_PP
    slid = state.reference[0] - duty >= SLIDE
    pinned = duty <= gains.min_duty + 1e-9
    if over and (slid or pinned) and measured.cycles < gains.max_cycles:
        state.cycles, state.cycle_set_s, state.reference = measured.cycles * 2, measured.now_s, None
