"""Scoring ``bench/scenarios.py``'s runs: what each container should get, what it got, the figures.

Per phase, a container's *alone* figure is what it uses alone on the whole GPU, unthrottled
(its own run, no controller, same engine and start time), over the phase's scored window.
Its *expected* share (:func:`expected_shares`):

- fixed-share: min(cap, alone);
- burst-share: min(request, alone) while some other container of the phase has alone
  >= ACTIVE_PCT (contended), else min(limit, alone) (limit: 100 when unset);

where min(target, alone) is taken per second of the window (``Claim.bins``, its use alone in
each second) and averaged: a cap holds per second of use, so a bursty container on 3 s at
full speed and off 3 s expects its cap while on and nothing while off, not its cap against
its mean;
- best-effort: what is left, water-filled: the capacity C (the GPU's total throughput with
  every container of the phase unthrottled together, at most 100) less the others'
  expected, divided max-min among the best-effort containers with their alone as demand.

What it *got*: its GPU seconds over the scored window (the engine's truth), as percent of it.
A fixed/burst container's *target* (:func:`target`) is its cap; for burst-share its limit while
uncontended, its request while contended. The figures over a set of mixes (:func:`figures`):
``within3`` (share of scored (container, phase) pairs with |got - expected| <= BAND_PP),
``p95_abs_pp``, ``max_over_pp`` (fixed/burst: got - target, >= 0), ``max_short_pp``
(fixed/burst: expected - got, >= 0), ``longest_under_cap_freeze_s`` (the longest freeze,
clipped to the window, of a container short by more than BAND_PP there),
``idle_while_short_pct`` (percent of scored time the GPU did no work while a container short
over the trailing SHORT_WINDOW_S was frozen with work it could not run: :func:`idle_while_short`),
``view_p95_err_pp`` (the controller's reading over 10 s against the truth over the same 10 s)
and ``settle_p95_s`` (:func:`settle_s`).

Each phase also has its *time one at a time* (:func:`one_at_a_time`): the share of the wall
clock its containers would need to get their expected shares if each ran alone in turns,
the sum of expected / alone. Up to 1, a schedule of exclusive turns can give every container
what it should get (less what switching and drains cost); over 1 it cannot, and the rest
must come from running containers together, where the GPU time-slices them evenly whatever
each is owed (a container that thinks between steps loses part of its own use to a busy
neighbour, and no freezer acts fast enough to give it the GPU only while it has work).
:func:`by_one_at_a_time` scores the pairs of each class apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from scenario_mixes import VIEW_WINDOW_S, Member, Mix, References, Trace

ACTIVE_PCT = 5.0  # a neighbour using this much alone contends with a burst-share container
BAND_PP = 3.0
SHORT_WINDOW_S = 5.0
SETTLE_STEP_S = 0.5
SETTLE_TAIL_S = 10.0  # settling is looked for up to this long before the phase's end
FIGURES = (
    "within3",
    "p95_abs_pp",
    "max_over_pp",
    "max_short_pp",
    "longest_under_cap_freeze_s",
    "idle_while_short_pct",
    "view_p95_err_pp",
    "settle_p95_s",
)


@dataclass(frozen=True)
class Claim:
    """One container of a phase, as the expected shares see it."""

    policy: str
    cores: int  # fixed-share: its cap; burst-share: its request
    limit: int  # burst-share: its limit (100 unset); the others: unused
    alone: float  # percent of the GPU it uses alone
    bins: tuple[float, ...] = ()  # ...in each second of the window (empty: ``alone`` throughout)

    def capped(self, goal: float) -> float:
        """Its use alone held to ``goal`` in each second, over the window."""
        if not self.bins:
            return min(goal, self.alone)
        return sum(min(goal, b) for b in self.bins) / len(self.bins)


def claim_of(member: Member, alone: float, bins: Sequence[float] = ()) -> Claim:
    return Claim(member.policy, member.cores, member.limit or 100, alone, tuple(bins))


def contended(claims: Sequence[Claim], i: int) -> bool:
    return any(j != i and c.alone >= ACTIVE_PCT for j, c in enumerate(claims))


def target(claims: Sequence[Claim], i: int) -> float | None:
    """What the controller must hold container ``i`` to (None: best-effort, nothing)."""
    c = claims[i]
    if c.policy == "fixed-share":
        return float(c.cores)
    if c.policy == "burst-share":
        return float(c.cores if contended(claims, i) else c.limit)
    return None


def water_fill(amount: float, demands: Sequence[float]) -> list[float]:
    """``amount`` divided max-min: nobody over its demand, the rest evenly."""
    out = [0.0] * len(demands)
    left = max(0.0, amount)
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    for n, i in enumerate(order):
        out[i] = min(max(0.0, demands[i]), left / (len(order) - n))
        left -= out[i]
    return out


def expected_shares(claims: Sequence[Claim], capacity: float) -> list[float]:
    """Each container's expected share of the phase (see the module docstring)."""
    out = [0.0] * len(claims)
    for i, c in enumerate(claims):
        goal = target(claims, i)
        if goal is not None:
            out[i] = c.capped(goal)
    best = [i for i, c in enumerate(claims) if c.policy == "best-effort"]
    held = sum(out[i] for i in range(len(claims)) if i not in best)
    shares = water_fill(min(100.0, capacity) - held, [claims[i].alone for i in best])
    for i, share in zip(best, shares, strict=True):
        out[i] = share
    return out


def settle_s(trace: Trace, name: str, start: float, end: float, expected: float) -> float:
    """The smallest s (steps of SETTLE_STEP_S, 0 to the phase's length less SETTLE_TAIL_S) for
    which what the container got over [start + s, end] is within BAND_PP of ``expected``; the
    longest s when none is."""
    longest = max(0.0, end - start - SETTLE_TAIL_S)
    for k in range(math.floor(longest / SETTLE_STEP_S + 1e-9) + 1):
        s = k * SETTLE_STEP_S
        if abs(trace.pct(name, start + s, end) - expected) <= BAND_PP:
            return s
    return longest


def longest_freeze(freezes: Sequence[tuple[float, bool]], start: float, end: float) -> float:
    """The longest single freeze of ``freezes`` ((time, frozen) records), clipped to [start, end];
    one still on at the end lasts to ``end``."""
    longest, since = 0.0, None
    for at, frozen in [*freezes, (math.inf, False)]:
        if frozen and since is None:
            since = at
        elif not frozen and since is not None:
            longest = max(longest, min(at, end) - max(since, start))
            since = None
    return max(0.0, longest)


def idle_while_short(trace: Trace, start: float, end: float, expected: dict[str, float]) -> float:
    """Seconds of [start, end] the GPU did no work (one less the contexts' summed GPU seconds
    over each step of the trace) while some container of ``expected`` was short of its expected
    by more than BAND_PP over the trailing SHORT_WINDOW_S and, at the step's start, frozen with
    work it could not run (not in a host Sleep)."""
    idle = 0.0
    names = list(trace.ran)
    for i in range(trace.index(start), trace.index(end)):
        at = trace.t0 + i * trace.step_s
        if not any(
            trace.waiting[n][i] and trace.pct(n, at - SHORT_WINDOW_S, at) < want - BAND_PP
            for n, want in expected.items()
            if i < len(trace.waiting[n])
        ):
            continue
        work = sum(trace.ran[n][i + 1] - trace.ran[n][i] for n in names if i + 1 < len(trace.ran[n]))
        idle += max(0.0, trace.step_s - work)
    return idle


@dataclass
class Record:
    """One scored (container, phase) of one controller's run."""

    controller: str
    mix: int
    sample_period_s: float
    name: str
    member: str  # its description
    kind: str
    policy: str
    phase: int
    alone: float
    capacity: float
    expected: float
    target: float | None
    got: float
    error: float
    settle_s: float
    longest_freeze_s: float
    short: bool
    one_at_a_time: float = 0.0  # its phase's (see the module docstring)


@dataclass
class MixScore:
    controller: str
    mix: Mix
    records: list[Record] = field(default_factory=list)
    scored_s: float = 0.0
    idle_short_s: float = 0.0
    view_errors: list[float] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]


def expected_of(mix: Mix, refs: References, phase: int) -> tuple[list[Member], list[Claim], list[float]]:
    members = mix.phase(phase)
    claims = [
        claim_of(m, refs.alone[m.name, phase], refs.alone_bins.get((m.name, phase), ())) for m in members
    ]
    return members, claims, expected_shares(claims, refs.capacity[phase])


ALONE_FLOOR_PCT = 0.5  # a container using less alone needs no time of its own


def one_at_a_time(claims: Sequence[Claim], wants: Sequence[float]) -> float:
    """The share of the wall clock the phase's containers need one at a time (module docstring)."""
    return sum(w / c.alone for c, w in zip(claims, wants, strict=True) if c.alone >= ALONE_FLOOR_PCT)


def score_mix(controller: str, mix: Mix, refs: References, trace: Trace, settle: float) -> MixScore:
    out = MixScore(controller, mix)
    for phase in (0, 1):
        start, end = mix.window(phase, settle)
        phase_start = start - settle
        members, claims, wants = expected_of(mix, refs, phase)
        needs = one_at_a_time(claims, wants)
        for i, (m, want) in enumerate(zip(members, wants, strict=True)):
            got = trace.pct(m.name, start, end)
            out.records.append(
                Record(
                    controller=controller,
                    mix=mix.index,
                    sample_period_s=mix.sample_period_s,
                    name=m.name,
                    member=m.describe(),
                    kind=m.kind,
                    policy=m.policy,
                    phase=phase,
                    alone=claims[i].alone,
                    capacity=refs.capacity[phase],
                    expected=want,
                    target=target(claims, i),
                    got=got,
                    error=got - want,
                    settle_s=settle_s(trace, m.name, phase_start, end, want),
                    longest_freeze_s=longest_freeze(trace.freezes.get(m.name, []), start, end),
                    short=got < want - BAND_PP,
                    one_at_a_time=needs,
                )
            )
        out.scored_s += end - start
        out.idle_short_s += idle_while_short(
            trace, start, end, {m.name: w for m, w in zip(members, wants, strict=True)}
        )
        names = {m.name for m in members}
        for at, name, value, until in trace.readings:
            if name in names and start - 1e-9 <= at <= end + 1e-9:
                truth = trace.pct(name, until - VIEW_WINDOW_S, until)
                out.view_errors.append(abs(value - truth))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), linear between ranks; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    x = q * (len(ordered) - 1)
    lo = math.floor(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)


ONE_AT_A_TIME_CLASSES = ((-math.inf, 0.9, "<= 0.9"), (0.9, 1.1, "0.9-1.1"), (1.1, math.inf, "> 1.1"))


PAIR_FIGURES = (
    "within3",
    "p95_abs_pp",
    "max_over_pp",
    "max_short_pp",
    "longest_under_cap_freeze_s",
    "settle_p95_s",
)


def pair_figures(records: Sequence[Record]) -> dict[str, float]:
    """The figures of FIGURES that are scored per (container, phase) pair (PAIR_FIGURES):
    ``max_over_pp`` and ``max_short_pp`` over the fixed and burst shares only, the longest
    freeze over the pairs short of what they should get."""
    held = [r for r in records if r.policy != "best-effort"]
    return {
        "within3": sum(abs(r.error) <= BAND_PP for r in records) / len(records) if records else 0.0,
        "p95_abs_pp": percentile([abs(r.error) for r in records], 0.95),
        "max_over_pp": max([0.0, *(r.got - r.target for r in held if r.target is not None)]),
        "max_short_pp": max([0.0, *(r.expected - r.got for r in held)]),
        "longest_under_cap_freeze_s": max((r.longest_freeze_s for r in records if r.short), default=0.0),
        "settle_p95_s": percentile([r.settle_s for r in records], 0.95),
    }


def by_one_at_a_time(scores: Sequence[MixScore]) -> list[tuple[str, str, int, dict[str, float]]]:
    """(class of the phase's time one at a time, policy group, pairs, their pair_figures),
    guaranteed (fixed and burst shares) and best-effort apart."""
    records = [r for s in scores for r in s.records]
    out = []
    for low, high, label in ONE_AT_A_TIME_CLASSES:
        for group, best in (("guaranteed", False), ("best-effort", True)):
            these = [
                r for r in records if low < r.one_at_a_time <= high and (r.policy == "best-effort") == best
            ]
            if these:
                out.append((label, group, len(these), pair_figures(these)))
    return out


def figures(scores: Sequence[MixScore]) -> dict[str, float]:
    scored_s = sum(s.scored_s for s in scores)
    pairs = pair_figures([r for s in scores for r in s.records])
    return {
        **pairs,
        "idle_while_short_pct": 100 * sum(s.idle_short_s for s in scores) / scored_s if scored_s else 0.0,
        "view_p95_err_pp": percentile([e for s in scores for e in s.view_errors], 0.95),
    }
