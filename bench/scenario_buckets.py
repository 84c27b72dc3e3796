"""A candidate decision layer for the compute caps, for ``bench/scenarios.py`` (not the product).

Per capped container a **bucket** of GPU seconds: it earns its target share of every second,
pays for what it ran, is frozen when the bucket is empty (less the work expected to drain
after the freeze) and thawed once it has earned again; a bucket holds ``bank_s`` of its share
plus one unit of its work, so a cap holds per second of use. A capped container short of its
target while the GPU is busy is *deprived*: everyone *ahead* (best-effort, and capped ones at
or over their target) then yields the first ``yield_fraction`` of each control period, a
fraction that rises with the worst relative shortfall while the GPU stays busy, eases while it
has room and decays once nobody is short. Everyone may run concurrently otherwise (no turns).

It is measured two ways, to separate the decision from the accounting
(:mod:`scenario_oracles` registers them):

- on the engine's ground truth (each container's GPU seconds every control period: an upper
  bound no agent can read, the figure of the decision alone);
- on the agent's own turn meter (device samples replayed through the thaw record,
  ``agent.domain.fluid``), as a real agent would read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.domain.annotations import Policy

MIN_THAW_S = 0.005  # no thaw shorter than this is planned (a thaw lets a queue of work in)


@dataclass(frozen=True)
class BucketSettings:
    bank_s: float = 0.5  # a bucket holds this many seconds of its share (plus one unit of work)
    debt_s: float = 60.0  # ...and goes at most this many seconds of its share into debt
    deprived_window_s: float = 2.0  # deprivation is judged over this much measured time
    deprived_margin: float = 0.02  # short of its target by more than this share of the GPU...
    busy_percent: float = 90.0  # ...while the GPU was at least this busy
    yield_gain: float = 0.6  # the yield fraction rises by this x the relative shortfall a period
    yield_decay: float = 0.85  # ...falls by this factor a period once nobody is deprived
    yield_ease: float = 0.97  # ...or by this one while the GPU has room (its own demand lacks)
    active_percent: float = 5.0  # a neighbour using this much contends with a burst-share one
    active_window_s: float = 5.0  # ...over this much time
    min_rate: float = 0.05  # a thawed container's use rate is taken as at least this


@dataclass
class Bucket:
    """One capped container's GPU seconds, settled to ``measured_to``."""

    share: float
    balance: float
    measured_to: float

    def settle(self, until: float, ran_s: float, settings: BucketSettings, unit_s: float) -> None:
        earned = self.share * max(0.0, until - self.measured_to)
        limit = self.share * settings.bank_s + unit_s
        self.balance = min(limit, max(-self.share * settings.debt_s, self.balance + earned - ran_s))
        self.measured_to = max(self.measured_to, until)

    def now(self, at: float, projected_s: float) -> float:
        """The balance at ``at``: measured, earned since, less what it is expected to have run."""
        return self.balance + self.share * max(0.0, at - self.measured_to) - projected_s


@dataclass(frozen=True)
class Member:
    """One container of the GPU as the decision sees it this period."""

    key: str
    policy: Policy
    request: int
    ceiling: int | None  # None: a whole GPU, never held
    frozen: bool
    used_pct: float  # its use over the deprived window, percent of the GPU
    thawed_frac: float  # share of that window it was thawed
    active_pct: float  # its use over the active window
    projected_s: float  # what it is expected to have run since the measured time
    rate: float  # its use while thawed, share of the GPU
    drain_s: float  # GPU seconds expected to run on after its freeze
    unit_s: float  # its longest unit of work (a step, a graph)


@dataclass
class Plan:
    """The coming control period: (offset from its start, key, thaw?) and why."""

    actions: list[tuple[float, str, bool]] = field(default_factory=list)
    targets: dict[str, float | None] = field(default_factory=dict)
    deprived: set[str] = field(default_factory=set)


def target_percent(member: Member, others: Sequence[Member], settings: BucketSettings) -> float | None:
    if member.ceiling is None or member.policy is Policy.BEST_EFFORT:
        return None
    if member.policy is Policy.BURST_SHARE:
        contended = any(o.active_pct >= settings.active_percent or o.frozen for o in others)
        return float(member.request if contended else member.ceiling)
    return float(member.ceiling)


class BucketBook:
    """One GPU's buckets and yield fraction."""

    def __init__(self, settings: BucketSettings | None = None) -> None:
        self.settings = settings or BucketSettings()
        self.buckets: dict[str, Bucket] = {}
        self.yield_fraction = 0.0
        self.protected: set[str] = set()  # deprived last period: protected while still short

    def settle(self, key: str, until: float, ran_s: float, unit_s: float) -> None:
        bucket = self.buckets.get(key)
        if bucket is not None:
            bucket.settle(until, ran_s, self.settings, unit_s)

    def plan(
        self, now: float, period_s: float, members: Sequence[Member], busy_pct: float, measured_to: float
    ) -> Plan:
        plan = Plan()
        for key in set(self.buckets) - {m.key for m in members}:
            del self.buckets[key]
        for m in members:
            self._target(plan, m, [o for o in members if o.key != m.key], busy_pct, measured_to)
        self._steer(plan, members, busy_pct)
        for m in members:
            self._act(plan, m, now, period_s)
        plan.actions.sort(key=lambda a: (a[0], a[2]))
        return plan

    def _target(
        self, plan: Plan, m: Member, others: Sequence[Member], busy_pct: float, measured_to: float
    ) -> None:
        s = self.settings
        goal = target_percent(m, others, s)
        plan.targets[m.key] = goal
        if goal is None or goal >= 100:
            self.buckets.pop(m.key, None)
            return
        bucket = self.buckets.get(m.key)
        if bucket is None:
            bucket = self.buckets[m.key] = Bucket(goal / 100, goal / 100 * s.bank_s, measured_to)
        bucket.share = goal / 100
        short = m.used_pct < goal - 100 * s.deprived_margin and bucket.balance > 0
        if short and (m.key in self.protected or (m.thawed_frac >= 0.5 and busy_pct >= s.busy_percent)):
            plan.deprived.add(m.key)

    def _steer(self, plan: Plan, members: Sequence[Member], busy_pct: float) -> None:
        s = self.settings
        shortfall = max(
            (
                1 - m.used_pct / max(plan.targets[m.key] or 1.0, 1e-9)
                for m in members
                if m.key in plan.deprived
            ),
            default=0.0,
        )
        if plan.deprived and busy_pct >= s.busy_percent:
            self.yield_fraction = min(1.0, self.yield_fraction + s.yield_gain * shortfall)
        else:
            self.yield_fraction *= s.yield_ease if plan.deprived else s.yield_decay
        if self.yield_fraction < 0.02:
            self.yield_fraction = 0.0
            plan.deprived.clear()
        self.protected = set(plan.deprived)

    def _act(self, plan: Plan, m: Member, now: float, period_s: float) -> None:
        s = self.settings
        goal = plan.targets[m.key]
        ahead = m.key not in plan.deprived and (goal is None or m.used_pct >= goal - 100 * s.deprived_margin)
        start = self.yield_fraction * period_s if plan.deprived and ahead else 0.0
        if start > 0:
            plan.actions.append((0.0, m.key, False))
        if start >= period_s - MIN_THAW_S:
            return  # yields the whole period: a thaw at its very end would let a queue in
        bucket = self.buckets.get(m.key)
        if bucket is None:
            plan.actions.append((start, m.key, True))
            return
        balance, run_from = bucket.now(now, m.projected_s), start
        if balance <= 0:
            plan.actions.append((0.0, m.key, False))
            run_from = max(start, -balance / bucket.share)
            if run_from >= period_s - MIN_THAW_S:
                return
            balance = 0.0
        plan.actions.append((run_from, m.key, True))
        freeze_at = run_from + max(0.0, balance - m.drain_s) / max(s.min_rate, m.rate)
        if freeze_at < period_s:
            plan.actions.append((freeze_at, m.key, False))
