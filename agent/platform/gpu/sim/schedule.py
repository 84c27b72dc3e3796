"""How one GPU shares its time between contexts that have work queued: pure functions.

Both answer the same question: given each context's queued GPU time (seconds of whole-GPU
work), how much of it does each context get done over the next ``span`` seconds, or how long
until some contexts have had a given amount done (``goals``)? Nothing new is submitted
meanwhile; the engine calls these between submissions.

- :class:`RoundRobin`: without MPS. Contexts with queued work take turns for one
  timeslice each, round-robin in a fixed order; a context whose queue empties gives up the
  rest of its slice; work longer than a slice is preempted at the slice's end and resumed on
  its next turn (compute preemption). A context alone runs without a break.
- :func:`serve_concurrent`: MPS. Clients run at once, each at most at its share of the GPU
  (its active-thread percentage); when the active clients' shares add up to more than the
  whole GPU, it is divided max-min fairly within those ceilings (water-filling).

Whole rounds of a time-sliced schedule are taken in one step, so the cost is proportional
to the number of contexts and of queues that empty, not to the number of slices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EPS = 1e-12  # seconds; below this an amount of work counts as none


@dataclass
class Served:
    """What a stretch of schedule did."""

    served: list[float]  # GPU time each context got done, same order as the input
    elapsed: float  # seconds that passed (``span``, or less when every goal was met first)
    busy: float  # seconds during which at least one context ran
    reached: dict[int, float]  # goal index -> seconds from the start at which it was met


def _next_active(rem: Sequence[float], after: int) -> int:
    n = len(rem)
    for step in range(1, n + 1):
        i = (after + step) % n
        if rem[i] > EPS:
            return i
    return after


@dataclass
class RoundRobin:
    """Where time-slicing stands: ``cursor`` holds the GPU with ``slice_left`` of its slice;
    ``last`` is the context whose state is loaded. Running another one first costs
    ``switch_s`` (saving one context's state and loading the next: the engine is busy and no
    work moves), of which ``switch_left`` is still to go when a stretch ended inside one."""

    timeslice: float
    cursor: int = 0
    slice_left: float = -1.0  # negative: no slice started (0: the cursor's slice is used up)
    switch_s: float = 0.0
    last: int = -1
    switch_left: float = 0.0

    def copy(self) -> RoundRobin:
        return RoundRobin(
            self.timeslice, self.cursor, self.slice_left, self.switch_s, self.last, self.switch_left
        )

    def serve(
        self, remaining: Sequence[float], span: float, goals: Mapping[int, float] | None = None
    ) -> Served:
        """Round-robin time-slicing for up to ``span`` seconds (``math.inf``: until every goal
        is met or every queue is empty); ``goals`` maps a context to the GPU time it must get
        before the run may stop. Advances the cursor."""
        run = _Run(remaining, goals)
        n = len(remaining)
        cur = self.cursor if 0 <= self.cursor < n else 0
        left = self.slice_left if 0 <= self.slice_left <= self.timeslice else self.timeslice
        last = self.last if 0 <= self.last < n else -1
        switch_left = self.switch_left if last != cur else 0.0
        while run.t < span - EPS and n and not run.all_reached():
            active = [i for i in range(n) if run.rem[i] > EPS]
            if not active:
                break
            if run.rem[cur] <= EPS or left <= EPS:
                nxt = _next_active(run.rem, cur)
                if nxt != cur or run.rem[cur] <= EPS:
                    cur, switch_left = nxt, 0.0
                left = self.timeslice
            if cur != last:  # load its state first
                if switch_left <= EPS:
                    switch_left = self.switch_s
                step = min(switch_left, span - run.t)
                run.switching(step)
                switch_left -= step
                if switch_left > EPS:
                    break  # the stretch ends inside the switch
                last, switch_left = cur, 0.0
                continue
            if len(active) == 1:  # alone: no switching, the slice clock just runs on
                amount = min(span - run.t, run.rem[cur], run.goal_left(cur))
                run.give(cur, amount, amount)
                left = self.timeslice - (self.timeslice - left + amount) % self.timeslice
                continue
            if left >= self.timeslice - EPS:
                rounds = self._whole_rounds(run, active, span)
                if rounds:  # every active context gets whole slices for ``rounds`` rounds
                    turns = rounds * len(active)
                    step = turns * self.timeslice + (turns - 1) * self.switch_s
                    for i in active:
                        run.give(i, rounds * self.timeslice, step, advance=False)
                    run.t += step
                    run.busy += step
                    last = active[active.index(cur) - 1]  # the round ends with the one before
                    continue
            amount = min(left, run.rem[cur], span - run.t, run.goal_left(cur))
            run.give(cur, amount, amount)
            left -= amount
        self.cursor, self.slice_left, self.last, self.switch_left = cur, left, last, switch_left
        return run.result(span)

    def _whole_rounds(self, run: _Run, active: Sequence[int], span: float) -> int:
        rounds = min(int((run.rem[i] + EPS) // self.timeslice) for i in active)
        if span < math.inf:
            turn = self.timeslice + self.switch_s
            rounds = min(rounds, int((span - run.t + EPS) // (len(active) * turn)))
        for i in active:
            if i in run.need and i not in run.reached:
                # Stop short of the goal: the slice that meets it is served one at a time.
                rounds = min(
                    rounds, max(0, math.ceil((run.need[i] - run.served[i]) / self.timeslice - EPS) - 1)
                )
        return max(0, rounds)


class _Run:
    """The bookkeeping of one ``serve``: what each context got, and when goals were met."""

    def __init__(self, remaining: Sequence[float], goals: Mapping[int, float] | None) -> None:
        n = len(remaining)
        self.rem = [max(0.0, r) for r in remaining]
        self.served = [0.0] * n
        self.need = {i: g for i, g in (goals or {}).items() if 0 <= i < n}
        self.reached: dict[int, float] = {i: 0.0 for i, g in self.need.items() if g <= EPS}
        self.t = 0.0
        self.busy = 0.0

    def all_reached(self) -> bool:
        return bool(self.need) and len(self.reached) == len(self.need)

    def goal_left(self, i: int) -> float:
        return self.need[i] - self.served[i] if i in self.need and i not in self.reached else math.inf

    def switching(self, duration: float) -> None:
        """A context switch: the engine is busy, nobody's work moves."""
        self.t += duration
        self.busy += duration

    def give(self, i: int, amount: float, duration: float, *, advance: bool = True) -> None:
        """Context ``i`` got ``amount`` of work done; ``duration`` seconds passed (when
        ``advance``; whole rounds move the clock once for all)."""
        end = self.t + duration
        self.served[i] += amount
        self.rem[i] -= amount
        if i in self.need and i not in self.reached and self.served[i] >= self.need[i] - EPS:
            self.reached[i] = end
        if advance:
            self.t = end
            self.busy += duration

    def result(self, span: float) -> Served:
        elapsed = span if span < math.inf and self.t < span else self.t  # the rest the GPU idled
        return Served(self.served, elapsed, self.busy, self.reached)


def water_fill(shares: Sequence[float], capacity: float = 1.0) -> list[float]:
    """Rates for clients each limited to its share, the capacity divided max-min fairly."""
    rates = [0.0] * len(shares)
    left = capacity
    order = sorted(range(len(shares)), key=lambda i: shares[i])
    for k, i in enumerate(order):
        fair = left / (len(order) - k)
        rates[i] = max(0.0, min(shares[i], fair))
        left -= rates[i]
    return rates


def serve_concurrent(
    remaining: Sequence[float],
    shares: Sequence[float],
    span: float,
    goals: Mapping[int, float] | None = None,
) -> Served:
    """MPS: active clients run together at their water-filled rates for up to ``span``."""
    n = len(remaining)
    rem = [max(0.0, r) for r in remaining]
    served = [0.0] * n
    need = {i: g for i, g in (goals or {}).items() if 0 <= i < n}
    reached: dict[int, float] = {i: 0.0 for i, g in need.items() if g <= EPS}
    t = busy = 0.0
    while t < span - EPS and (not need or len(reached) < len(need)):
        active = [i for i in range(n) if rem[i] > EPS and shares[i] > 0]
        if not active:
            break
        rates = dict(zip(active, water_fill([shares[i] for i in active]), strict=True))
        dt = min(rem[i] / rates[i] for i in active if rates[i] > 0)
        dt = min(dt, span - t)
        for i in active:
            if i in need and i not in reached and rates[i] > 0:
                dt = min(dt, (need[i] - served[i]) / rates[i])
        dt = max(dt, 0.0)
        for i in active:
            amount = min(rem[i], rates[i] * dt)
            served[i] += amount
            rem[i] -= amount
            if i in need and i not in reached and served[i] >= need[i] - EPS:
                reached[i] = t + dt
        t += dt
        busy += dt
    if span < math.inf and t < span:
        t = span
    return Served(served, t, busy, reached)
