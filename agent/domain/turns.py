"""Turns on one GPU: which held container runs when, so that each gets its share of the
GPU's throughput and nobody more.

Held containers (those that would run over their target) take *turns*: at most one is
thawed at a time, alone on the GPU (best-effort and other unheld containers yield to it,
:mod:`agent.control.turnloop`), so that whose work a device sample shows is known
(:mod:`.fluid`) and a time-sliced neighbour's context switches cost it nothing. Between
turns the unheld containers run.

Each held container has an account of GPU seconds (a deficit counter, as in deficit round
robin): it earns its target share of every second and pays for the work it did, measured
from the device samples where they already cover the time, predicted from the agent's own
record where they do not yet (what its thawed time and its drain will have cost). The
account is what holds the cap over time: a turn that ran long (a step, a graph that ran on
after the freeze) is paid for by a longer wait before the next, so the mean holds whatever
the unit of work, and late device samples correct the prediction without ever being
counted twice.

The turns go in cycles of ``cycle_s``: in each, every held container with something in
its account (a quarter of its quantum, its share of the cycle) takes one turn, the one
furthest behind first, then the unheld containers run until the cycle ends. A turn spends
the account: the container is thawed for what the account buys less the drain expected
after the freeze (at least ``min_thaw_s``, which lets one unit of its work in). A container
in debt (a unit of work longer than its share of a cycle) sits out cycles until it has
paid. Nobody waits frozen longer than ``max_wait_s``: a container whose unit of work is
too long for its share to be repaid within that (a queue of seconds refilled at every
thaw) still gets a turn then, and is reported as not holdable.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

LONG_UNIT = 0.5  # units at least this much of a quantum are let in whole (below: a plain thaw)
UNIT_MARGIN = 1.05  # a thaw for k units ends this far into the k-th, so that it has started
MIN_SPEND = 0.25  # a turn is worth taking with this much of a quantum in the account
BANK_QUANTA = 2.0  # an account holds at most this many quanta: enough to wait for a turn


@dataclass(frozen=True)
class TurnSettings:
    cycle_s: float = 0.5  # nominal cycle: a container's quantum is its share of this
    min_thaw_s: float = 0.01  # the shortest thaw: enough for a frozen process to submit again
    max_wait_s: float = 8.0  # nobody waits frozen longer for its next turn
    max_turn_s: float = 2.0  # the longest thaw of one turn
    # A turn waits at most this long for the work the others frozen for it still run (their
    # drains) before its owner is thawed beside that work. Longer waits kept each turn's
    # device samples its own, but left the owner frozen behind a neighbour's graph or deep
    # queue for up to seconds: its guarantee taken by the neighbour's queue depth
    # (docs/benchmarks.md: the drain wait, side by side).
    max_drain_wait_s: float = 0.05
    # Whether unheld containers with a target of their own yield to held ones' turns. They do
    # not (False): under their cap they are owed what they use, and a container frozen for
    # others' turns loses its own time (one that thinks between steps starves); best-effort
    # ones always yield. True is the earlier behaviour, kept to compare (bench/scenarios.py).
    capped_yield: bool = False
    # Who is held (control/turnloop.py):
    active_percent: float = 5.0  # a container using this much of the GPU wants its share
    hold_margin_pp: float = 1.0  # an unheld container is held once measured this far over its target
    release_under_pp: float = 8.0  # a held one this far under its target over 4 s (idle_hold_s) is released
    starved_pp: float = 3.0  # ...or, yielding to others' turns, this far under it
    starved_s: float = 4.0  # ...for this long (not a start-up, not a pause of its own), on a booked GPU
    booked_percent: float = 95.0  # active containers' targets add up to this much: the GPU is booked
    used_window_s: float = 4.0  # status: a container's use over this much measured time
    enter_window_s: float = 1.0  # held as soon as its use over this much time is over the target
    yield_window_s: float = 30.0  # an unheld container that used the GPU this recently yields to turns
    idle_balance_quanta: float = 0.5  # an idle held container keeps at most this much of a quantum
    # When turns are taken (control/turnloop.py):
    slot_s: float = 0.004  # actions this close together go in one wake-up
    # On a crowded GPU (its cycle stretched), a held container's plain turn (not whole units)
    # ends in a wake-up the loop makes anyway, if that is within ride_s and ride_share of its
    # thaw of the planned end: later, where another GPU's action is planned then; earlier,
    # where the loop is awake for something else. On a full node each turn end was a
    # wake-up of its own, and a wake-up, not the work in it, was most of the loop's CPU. The
    # account pays for a shorter or longer turn with the next one, so the share holds.
    ride_s: float = 0.02
    ride_share: float = 0.25
    read_wait_share: float = 0.4  # a period's read of the samples waits this share of it at most
    first_drain_wait_s: float = 4.0  # the longest wait for a drain to show over in the samples
    min_cycle_s: float = 0.2  # the shortest cycle of turns
    # A crowded GPU's cycle stretches so that its turns last this long on average (at most
    # crowded_cycle_s): each turn costs a freeze and a thaw of a running process and a drain
    # wait, and 16 shares of 6 % in a 0.5 s cycle had turns of 30 ms (the price: a small
    # share waits up to the longer cycle for its next turn). At 0.1 s, 16 shares of 6 % take
    # 1.6 s cycles: in virtual time they hold as closely as in 0.8 s cycles (mean error 0.46
    # pp against 0.53 over 2-20 ms kernels), and the agent's CPU on that node fell a quarter.
    min_turn_s: float = 0.1
    crowded_cycle_s: float = 2.0
    cycle_per_wait: float = 10.0  # a cycle is this many times the waits its turns cost (overhead 10 %)
    seen_periods: int = 2  # a drain is seen over this many device sample periods after it ended


@dataclass
class Account:
    """One held container's deficit counter (GPU seconds, through ``measured_to``)."""

    share: float  # its target, share of the GPU (0..1)
    balance: float  # earned minus paid, measured
    measured_to: float  # wall time the measured balance runs to
    waiting_since: float  # frozen since (its last turn's end, or when it became held)
    unit: float = 0.0  # GPU seconds it runs after a freeze at most (a step, a graph in flight)
    cycle_s: float | None = None  # its GPU's cycle where crowded (None: the settings' cycle_s)

    def quantum(self, settings: TurnSettings) -> float:
        return self.share * (settings.cycle_s if self.cycle_s is None else self.cycle_s)

    def bank(self, settings: TurnSettings) -> float:
        """The most it may hold: enough to wait for others' turns, and for a whole unit of
        its work (a step longer than its quantum must not lose what it earns meanwhile)."""
        return max(BANK_QUANTA * self.quantum(settings), 2 * self.unit + self.quantum(settings))

    def settle(self, until: float, paid: float, settings: TurnSettings) -> None:
        """Measured: it earned its share up to ``until`` and did ``paid`` GPU seconds."""
        earned = self.share * max(0.0, until - self.measured_to)
        cap = self.bank(settings)
        floor = -self.share * settings.max_wait_s * 4  # beyond: it is forced anyway
        self.balance = min(cap, max(floor, self.balance + earned - paid))
        self.measured_to = max(self.measured_to, until)

    def now(self, at: float, predicted: float) -> float:
        """The balance at ``at``: measured, plus earned since, less the predicted work."""
        return self.balance + self.share * max(0.0, at - self.measured_to) - predicted


@dataclass
class Cycle(Generic[K]):
    """One round of turns: each held container takes at most one turn in it, then the unheld
    ones run until it ends. A regular cadence (a turn every cycle) delivers a share evenly."""

    start: float
    end: float
    served: set[K] = field(default_factory=set)


@dataclass(frozen=True)
class Turn(Generic[K]):
    key: K | None  # None: the unheld containers' turn
    start: float
    thaw_until: float  # the held container is frozen then
    next_decision: float
    drain: float | None = None  # GPU seconds expected to run on after its freeze
    units: int = 0  # whole units of work it lets in (0: a plain thaw of what its budget buys)


def next_turn(
    at: float,
    accounts: Mapping[K, Account],
    predicted: Mapping[K, float],
    *,
    drains: Mapping[K, float],
    rates: Mapping[K, float],
    settings: TurnSettings,
    cycle: Cycle[K],
    order: Sequence[K] = (),
    in_flight: Mapping[K, float] | None = None,
) -> Turn[K]:
    """The turn that starts at ``at`` in ``cycle``: a held container's (thaw it until
    ``thaw_until``), or the unheld containers' until the cycle ends. ``predicted``: work
    done but not yet measured, drains still to run included; ``drains``: the GPU seconds
    each runs after a freeze; ``rates``: the share of the GPU each keeps busy while thawed;
    ``order`` breaks ties (earlier first); ``in_flight``: until when each container's last
    unit is expected to run on after its freeze (no new turn before: it could not start
    anything meanwhile)."""
    balances = {k: a.now(at, predicted.get(k, 0.0)) for k, a in accounts.items()}
    busy = {k for k, until in (in_flight or {}).items() if until > at}
    rank = {k: i for i, k in enumerate(order)}
    forced = [k for k, a in accounts.items() if at - a.waiting_since >= settings.max_wait_s]
    ready = [
        k
        for k, a in accounts.items()
        if k not in cycle.served
        and k not in busy
        and balances[k] >= max(MIN_SPEND * a.quantum(settings), a.unit / 2)
    ]
    # Served already, but owed a whole quantum (its work comes in units longer than a
    # cycle): another turn rather than an idle GPU.
    owed = [
        k
        for k, a in accounts.items()
        if k in cycle.served and k not in busy and balances[k] >= max(a.quantum(settings), a.unit / 2)
    ]
    pool = forced or ready or owed
    if not pool:
        wake = cycle.end
        for key, account in accounts.items():
            wake = min(wake, account.waiting_since + settings.max_wait_s)
            if key in busy and (in_flight or {})[key] > at:
                wake = min(wake, (in_flight or {})[key])
        return Turn(None, at, at, max(wake, at + settings.min_thaw_s))

    def lag(key: K) -> tuple[float, float]:
        if forced:  # the longest waiting first
            return (at - accounts[key].waiting_since, -rank.get(key, 0))
        return (balances[key] / max(accounts[key].share, 1e-6), -rank.get(key, 0))

    key = max(pool, key=lag)
    cycle.served.add(key)
    unit = accounts[key].unit
    budget = max(0.0, balances[key])
    if unit > max(2 * settings.min_thaw_s, LONG_UNIT * accounts[key].quantum(settings)):
        # Work comes in units (a step, a graph): one starts when it is thawed, and the one
        # in flight at the freeze runs to its end. A thaw just past the start of the last
        # unit the budget buys lets in whole units, and the drain after it is a whole
        # unit, the same every time (so the wait after it wastes nothing).
        units = max(1, min(round(budget / unit), int(settings.max_turn_s / unit) + 1))
        thaw = settings.min_thaw_s + (units - 1) * unit * UNIT_MARGIN
        drain = max(0.0, unit - settings.min_thaw_s - (units - 1) * unit * (UNIT_MARGIN - 1))
        return Turn(key, at, at + thaw, at + thaw, drain, units)
    rate = max(0.05, min(1.0, rates.get(key, 1.0)))
    thaw = (budget - drains.get(key, 0.0)) / rate
    thaw = min(settings.max_turn_s, max(settings.min_thaw_s, thaw))
    return Turn(key, at, at + thaw, at + thaw, drains.get(key, 0.0))


def nominal_cycle(settings: TurnSettings, taking_turns: int) -> float:
    """The cycle a GPU's quanta are shares of: ``cycle_s``, longer where so many take turns
    that they would be shorter than ``min_turn_s`` on average."""
    return max(settings.cycle_s, min(settings.crowded_cycle_s, taking_turns * settings.min_turn_s))
