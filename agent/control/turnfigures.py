"""What status shows of a held container under turns: its duty (the share of the recent time
it was thawed), its cycle (the mean time between its turns), its drain, and whether its cap
can be held by freezing at all (and if not, why, in the words a user reads).

Worked out from the turn loop's record of each container's thaws, at most once a second per
held container: they are status figures, not inputs of the decision.
"""

from __future__ import annotations

import collections
import math

from agent.control.containers import ContainerControl
from agent.domain.fluid import Demand

FIGURES_S = 10.0  # duty and cycle: over the turns of this long...
FIGURES_EVERY_S = 1.0  # ...worked out this often per held container

Thaws = collections.deque[tuple[float, float]]  # (thawed at, frozen at; inf while thawed)


def update_figures(
    control: ContainerControl,
    model: Demand | None,
    thaws: Thaws,
    figured: dict[str, float],
    *,
    held: bool,
    now: float,
    max_wait_s: float,
) -> None:
    """Set ``control``'s figures; ``figured``: when each container's were last worked out
    (kept by the caller, one per GPU); ``thaws`` is trimmed to the figures' window."""
    if model is not None:
        control.state.drain_s = model.drain_s
    if not held:
        control.state.duty, control.cycle_s, control.unholdable = 1.0, 0.0, ""
        figured.pop(control.key, None)
        return
    if now - figured.get(control.key, -math.inf) < FIGURES_EVERY_S:
        return  # status figures over 10 s: once a second is fresh enough
    figured[control.key] = now
    while thaws and thaws[0][1] < now - FIGURES_S:
        thaws.popleft()
    since = max(now - FIGURES_S, thaws[0][0]) if thaws else now - FIGURES_S
    thawed = sum(min(end, now) - max(start, since) for start, end in thaws if min(end, now) > since)
    control.state.duty = min(1.0, thawed / max(now - since, 1e-9))
    starts = [s for s, _e in thaws]
    control.cycle_s = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else 0.0
    if model is None:
        control.unholdable = ""
    elif model.runs_on_s > model.drain_s:
        control.unholdable = unholdable(control.goal, model.runs_on_s, "at least", max_wait_s)
    else:
        control.unholdable = unholdable(control.goal, model.drain_s, "about", max_wait_s)


def unholdable(goal: float | None, unit_s: float, about: str, max_wait_s: float) -> str:
    """Why a cap of ``goal`` % cannot be held by freezing ("" when it can): the ``unit_s`` of
    work that runs on after each freeze needs a longer wait to be paid for than anybody is
    kept frozen (``max_wait_s``)."""
    if goal is None or goal <= 0 or unit_s <= 0:
        return ""
    wait = unit_s * (100 / goal - 1)
    if wait <= max_wait_s:
        return ""
    return (
        f"{about} {unit_s:.1f} s of GPU work runs on after every freeze (a deep queue, a long graph or "
        f"step): a {goal:.0f} % share needs it frozen {wait:.0f} s after each turn and the freezer "
        f"waits at most {max_wait_s:.0f} s; MPS limits hold it (sharingMode: mps with "
        "mpsAdvisoryLimits: true, which a tenant can lift: trusted tenants only), or shorter kernels "
        "and more frequent syncs"
    )
