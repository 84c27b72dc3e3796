"""One GPU's duty cycle: when its throttled containers are thawed.

The GPU has one cycle, a power of two of control periods long: the longest any of its
throttled containers needs (a container whose work comes in long pieces needs a long
cycle, see :mod:`agent.domain.dutycontrol`). Every throttled container is thawed at the
start of each cycle and frozen when its duty of the cycle has passed. (Thawing them one
after another instead, so that each runs alone, was tried: it wastes the slice of a
container that does not use all of it, which its neighbours then lose, and it held the
caps no better; see docs/enforcement.md.)

A new cycle length takes effect at the next start of the current one, so the share of
time each container is thawed stays what it was across the change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CycleSchedule:
    """Where the GPU's cycles start: every ``length`` control periods from period ``phase``."""

    length: int = 1
    phase: int = 0
    since_s: float | None = None  # wall time the current length took effect (None: always)
    pending: tuple[int, int] | None = None  # (length, period index it starts at)

    def offset(self, index: int) -> int:
        """Periods since the cycle containing period ``index`` started."""
        return (index - self.phase) % self.length

    def request(self, length: int, index: int) -> None:
        """Switch to ``length`` at the first cycle start after period ``index``."""
        if length == self.length:
            self.pending = None
        elif self.pending is None or self.pending[0] != length:
            self.pending = (length, index + 1 + (-(index + 1 - self.phase)) % self.length)

    def advance(self, index: int, wall_s: float) -> bool:
        """Apply a pending length due at period ``index``; True when it changed."""
        if self.pending is not None and index >= self.pending[1]:
            (self.length, self.phase), self.pending = self.pending, None
            self.since_s = wall_s
            return True
        return False
