"""Who the turns hold on a GPU: each container's target by its policy, and when a container
is held (an account of its own, turns) or released.

- Held: measured over its target (by ``hold_margin_pp``, over the enter window), or, on a
  booked GPU, yielding to the held ones' turns and short of its target for ``starved_s``.
- Released: its target is gone (best-effort, whole GPUs); or it used well under its target
  (``release_under_pp``) for ``idle_hold_s``; or it did not spend what it earned for as long
  (it needs less than its share).

Decisions over the meter's figures. A hold opens the container's account (in the GPU's
``GpuTurnsData``) and a held one's share and unit follow its target here;
:class:`~agent.control.turnloop.TurnLoop` applies the rest (a release drops the account and
its pending actions, a new account brings the next decision forward).
"""

from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass, field

from agent.control.containers import ContainerControl
from agent.control.turnmeter import GpuTurnsData, TurnMeter
from agent.domain.annotations import Policy
from agent.domain.turns import Account, TurnSettings


class HoldChange(enum.Enum):
    HELD = "held"  # a new account: decide its turns now
    RELEASE = "release"


@dataclass
class HoldClocks:
    """Since when each container has been in a state that ends in a change once it lasts."""

    full_since: dict[str, float] = field(default_factory=dict)  # held, not spending
    light_since: dict[str, float] = field(default_factory=dict)  # held, well under its target
    starved_since: dict[str, float] = field(default_factory=dict)  # unheld, yielding, short

    def released(self, key: str) -> None:
        self.full_since.pop(key, None)
        self.light_since.pop(key, None)


def target(control: ContainerControl, active: Set[str]) -> float | None:
    """Its target, percent of the GPU: fixed-share its cap; burst-share its ceiling while
    alone, its request while a neighbour is ``active``; None with no ceiling."""
    spec = control.spec
    if spec.ceiling is None:
        return None
    if spec.policy is Policy.BURST_SHARE:
        contended = any(k != control.key for k in active)
        return float(spec.cores if contended else spec.ceiling)
    return float(spec.ceiling)


def is_active(meter: TurnMeter, settings: TurnSettings, gpu: int, key: str, recent: float | None) -> bool:
    """Whether the container uses the GPU now: over the last second (``recent``), or over
    two of its units of work where those are longer (steps of seconds come in bursts)."""
    model = meter.gpus[gpu].attribution.models.get(key)
    window = min(
        settings.used_window_s,
        max(settings.enter_window_s, 2 * model.drain_max_s if model is not None else 0.0),
    )
    used = recent if window == settings.enter_window_s else meter.used(gpu, key, window)
    return used is not None and used >= settings.active_percent


def used_lately(meter: TurnMeter, settings: TurnSettings, gpu: int, key: str) -> bool:
    """Whether the container used the GPU lately (it may again at any moment: a pause
    between bursts, a request after a quiet spell), by the device samples or NVML."""
    used = meter.used(gpu, key, settings.yield_window_s)
    return (used is not None and used > 0.1) or meter.credited(gpu, key, settings.yield_window_s)


def hold_or_release(
    data: GpuTurnsData,
    clocks: HoldClocks,
    control: ContainerControl,
    recent: float | None,
    now: float,
    *,
    settings: TurnSettings,
    idle_hold_s: float,
    booked: bool,
) -> HoldChange | None:
    """Whether ``control`` is newly held (its account is opened here) or to be released, by
    its target (``control.goal``) and use; ``recent``: its use over the enter window."""
    key, goal = control.key, control.goal
    account = data.accounts.get(key)
    model = data.attribution.models.get(key)
    idle = model is not None and model.idle
    if goal is None or goal >= 100:
        # A held container that is idle stays held whatever its target meanwhile (a
        # burst-share one whose neighbours paused with it): they come back held.
        if account is not None and not (idle and goal is not None):
            return HoldChange.RELEASE
        return None
    if account is None:
        # Over its target; or, on a booked GPU, yielding to others' turns and short of it
        # (freezing it for their turns costs it more than the slack): turns of its own and
        # an account see that it gets its share.
        if control.yielding and control.used < goal - settings.starved_pp:
            starved = booked and now - clocks.starved_since.setdefault(key, now) >= settings.starved_s
        else:
            clocks.starved_since.pop(key, None)
            starved = False
        if starved or (recent is not None and recent > goal + settings.hold_margin_pp):
            clocks.starved_since.pop(key, None)
            data.accounts[key] = account = Account(goal / 100, 0.0, data.attribution.replayed_to, now)
            account.balance = account.quantum(settings)
            return HoldChange.HELD
        return None
    account.share = goal / 100
    if model is not None and model.drains:
        # A unit that started as it was thawed and runs on after the shortest thaw.
        account.unit = model.drain_max_s + settings.min_thaw_s
    quantum = account.quantum(settings)
    if idle:  # it does not save up while it has nothing to run
        account.balance = min(account.balance, settings.idle_balance_quanta * quantum)
    full = settings.idle_balance_quanta * quantum if idle else account.bank(settings)
    unspent = account.balance >= full - 1e-9
    # Held, but using well under its target all along: its turns are not what keeps it
    # there (an open-loop server between requests); held, its long turns leave the GPU idle.
    if control.used < goal - settings.release_under_pp:
        if now - clocks.light_since.setdefault(key, now) >= idle_hold_s:
            return HoldChange.RELEASE
    else:
        clocks.light_since.pop(key, None)
    if unspent:
        if now - clocks.full_since.setdefault(key, now) >= idle_hold_s:
            return HoldChange.RELEASE  # it does not use what it earns: it needs less
    else:
        clocks.full_since.pop(key, None)
    return None
