"""When turns happen: how long a cycle of turns is, how long a turn waits for the drains of
those just frozen, and where a crowded GPU's turn ends to share a wake-up of the loop
(:class:`~agent.control.turnloop.TurnLoop` asks all three)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.domain.fluid import Attribution, Demand
from agent.domain.turns import Turn, TurnSettings, nominal_cycle


def cycle_length(
    settings: TurnSettings, taking_turns: Sequence[str], models: Mapping[str, Demand], typical_period_s: float
) -> float:
    """The next cycle: short where the waits between turns are (each turn costs one; short
    cycles deliver a share evenly, which is what a request's latency sees), at most the
    nominal cycle (``cycle_s``, longer on a crowded GPU: :func:`nominal_cycle`).
    ``taking_turns``: the held containers, then those that yield."""
    nominal = nominal_cycle(settings, len(taking_turns))
    if len(taking_turns) < 2:
        return nominal  # nobody to take turns with: no wait to pay for
    waits = []
    for key in taking_turns:
        wait = models[key].wait_s if key in models else None
        waits.append(nominal if wait is None else wait)
    # No shorter than a device sample: more turns per sample are more for the record to tell
    # apart, and no shorter than the sample shows.
    shortest = min(nominal, max(settings.min_cycle_s, typical_period_s))
    return max(shortest, min(nominal, settings.cycle_per_wait * sum(waits)))


def drain_wait(
    now: float,
    starting: set[str],
    frozen_at: dict[str, float],
    waiting_for: dict[str, float],
    *,
    attribution: Attribution[str],
    settings: TurnSettings,
    seen_after_s: float,
) -> float:
    """How long to wait before thawing ``starting``: until the drains of the others frozen
    lately (``frozen_at``, trimmed here) have run out, as long as each one's drains were seen
    to run (its ``wait_s``). After a container whose drain was never seen, or one whose drains
    are longer than the samples show within ``seen_after_s``, until the device samples show
    it over (it goes in ``waiting_for``; the loop decides again then), at most
    ``first_drain_wait_s``."""
    models = attribution.models
    until = now
    for key, at in list(frozen_at.items()):
        model = models.get(key)
        wait = model.wait_s if model is not None and model.wait_s is not None else None
        seen_over = attribution.drain_over.get(key, -math.inf) >= at
        if (
            key in starting
            or seen_over
            or now - at >= (settings.first_drain_wait_s if wait is None else wait)
        ):
            del frozen_at[key]
            continue
        if wait is None:
            waiting_for[key] = at
            wait = settings.first_drain_wait_s
        elif wait > seen_after_s:
            # Long drains: wait until the samples show it over (a blind wait would be cut
            # short by a longer one than those measured so far), at most twice the wait.
            waiting_for[key] = at
            wait = min(settings.first_drain_wait_s, 2 * wait)
        until = max(until, at + wait)
    return until - now


def _ride_window(turn: Turn[Any], settings: TurnSettings) -> float:
    """How far a plain held turn's end may move (0 for a turn of whole units or nobody's)."""
    if turn.key is None or turn.units:
        return 0.0
    return min(settings.ride_s, settings.ride_share * (turn.thaw_until - turn.start))


def rides(turn: Turn[Any] | None, early: float, settings: TurnSettings) -> bool:
    """Whether ``turn``, due to end ``early`` seconds from now, ends in this wake-up of the
    loop, made for something else, rather than in one of its own a little later."""
    return turn is not None and early <= _ride_window(turn, settings)


def ridden_end(turn: Turn[Any], end: float, planned: Iterable[float], settings: TurnSettings) -> float:
    """Where ``turn``, planned to end at ``end``, ends: at the first wake-up already
    ``planned`` for another GPU a little later, where there is one."""
    late = _ride_window(turn, settings)
    return min((t for t in planned if end < t <= end + late), default=end)
