"""What one of NVML's per-process samples says about a container's use, and how it corrects
the meter's split of the device samples.

The driver takes one per-process sample per device sample period, crediting the process
resident on the engine at that instant with its own SM activity over about the last second
(docs/gpu-model.md, the perfmon ring). Whether a process is credited at all is chance (who
was resident at the instant), so a sum of credits is no measure of a share. The *value* of a
credit is: it is the credited container's SM activity over the window, which is its GPU time
in the window times the SM activity of its kernels (its *activity factor*, below 1: a kernel
keeps part of the SMs busy). With the factor known, a credit of ``v`` percent says that the
container ran ``v / 100 / factor`` of the window.

That is what the thaw record cannot say when two containers ran at the same time (two
unheld ones thawed together, a drain under a neighbour's turn): the device samples give
their sum, and the record only that both could have run. Each credit therefore corrects the
meter's split over its window: the credited container's GPU time there is set to what the
credit says, and the difference is taken from, or given to, the containers that ran beside
it in that window, in proportion to what each was given. The busy time of the window is
conserved: a credit moves time between containers, never adds any.

A container's activity factor is learned from credits whose window it had to itself (the
device samples then measure its GPU time, up to a neighbour's work the record did not
expect); until then it is ``activity_prior``. *Had to itself* means a turn of its own: thawed
through every period of the window, nobody else the record says could have run, and nobody
else credited in that window or the one before. A window it spent frozen and draining is
no lesson: the record cannot see when a drain ends, so a neighbour's deep queue still
running beside it looks like nothing, and a factor learned there (a third of the true one
with two time-sliced deep queues) would make every later credit confirm the wrong split.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

EPS = 1e-9


@dataclass(frozen=True)
class CreditSettings:
    """How per-process samples are read (the driver's, docs/gpu-model.md)."""

    window_s: float = 1.0  # a credit is the process's SM activity over about this long...
    activity_prior: float = 0.867  # ...per second of its GPU time, until its own is learned
    activity_kept: int = 16  # a container's factor is learned from its last this many solo windows...
    activity_quantile: float = 0.8  # ...at this quantile...
    activity_windows: int = 4  # ...once there are this many
    activity_min: float = 0.2  # a learned factor stays within these bounds
    activity_max: float = 1.0
    settle_spread_s: float = 2.0  # a held container's account pays a correction over this long
    solo_min_share: float = 0.05  # a window it had to itself teaches its factor if it ran this much
    solo_beside_share: float = 0.005  # ...and nobody else was given more than this of it (no drain)
    solo_thawed_share: float = 0.9  # ...and it was thawed this much of each of its periods (a turn)
    solo_quiet_windows: int = 2  # ...and NVML credited nobody else in this many windows up to it


class CreditBook(Generic[K]):
    """Each container's activity factor, and the correction one credit makes."""

    def __init__(self, settings: CreditSettings | None = None) -> None:
        self.settings = settings or CreditSettings()
        self.activity: dict[K, float] = {}
        self._observed: dict[K, collections.deque[float]] = {}
        self.corrections = 0

    def window_s(self, period_s: float) -> float:
        """The span a credit covers: the driver averages over whole sample periods."""
        return max(1, round(self.settings.window_s / period_s)) * period_s

    def factor(self, key: K) -> float:
        return self.activity.get(key, self.settings.activity_prior)

    def correct(
        self, key: K, credit_pct: float, window_s: float, given: Mapping[K, float], *, alone: bool
    ) -> dict[K, float]:
        """The GPU seconds to add to each container's work (negative: to take away) so that
        the credited ``key``'s work over the credit's window is what the credit says, within
        the window's busy time. ``given``: what the meter gave each container over that
        window so far; ``alone``: the thaw record says nobody else could have run in it.
        What the credited container gains or loses, the others beside it in the window lose
        or gain, in proportion to what each was given."""
        s = self.settings
        own = given.get(key, 0.0)
        others = {k: v for k, v in given.items() if k != key and v > EPS}
        beside = sum(others.values())
        if alone:
            if own >= s.solo_min_share * window_s and beside <= s.solo_beside_share * window_s:
                self._learn(key, credit_pct / 100 / (own / window_s))
            return {}  # the device samples measured it already
        said = min(window_s, credit_pct / 100 / self.factor(key) * window_s)
        moved = max(-own, min(beside, said - own))
        if abs(moved) <= EPS or beside <= EPS:
            return {}  # nobody beside it to take the difference from (or give it to)
        self.corrections += 1
        out = {key: moved}
        for other, seconds in others.items():
            out[other] = -moved * seconds / beside
        return out

    def _learn(self, key: K, observed: float) -> None:
        """A window the record and NVML both say it had to itself. Its own GPU time there may
        still hold a neighbour's work that ran unexpected and uncredited (a drain longer than
        the record knew), which only lowers the figure: the factor is a high quantile of the
        recent ones, not their mean."""
        s = self.settings
        kept = self._observed.setdefault(key, collections.deque(maxlen=s.activity_kept))
        kept.append(max(s.activity_min, min(s.activity_max, observed)))
        if len(kept) < s.activity_windows:
            return  # too few to tell a lesson from a neighbour's unexpected drain
        ordered = sorted(kept)
        self.activity[key] = ordered[min(len(ordered) - 1, int(s.activity_quantile * len(ordered)))]

    def forget(self, key: K) -> None:
        self.activity.pop(key, None)
        self._observed.pop(key, None)
