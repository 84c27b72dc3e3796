"""When turns happen: how long a cycle of turns is, and how long a turn waits for the
drains of those just frozen (:class:`~agent.control.turnloop.TurnLoop` asks both)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from agent.domain.fluid import Attribution, Demand
from agent.domain.turns import TurnSettings, nominal_cycle


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
