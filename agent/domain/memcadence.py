"""How soon the memory guard checks again: the base period, or a short one while a container
is near its quota and growing, or heading for it at its measured rate.

A process that allocates 64 MiB every 20 ms grows 640 MiB in one 0.2 s period: checked only
at the base period, it is killed far over its quota. Checking every container at a short
period costs CPU all the time; checking at it only while one is about to cross costs it only
then. A container that sits still near its quota (a caching allocator's usual state) is not
growing, so it keeps the base period.

Pure: the caller passes times (monotonic seconds) and each container's use and quota.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CadenceSettings:
    base_s: float = 0.2  # every container is checked at least this often
    near_s: float = 0.01  # the period while one is near its quota; 0: always base_s (the old loop)
    near_fraction: float = 0.75  # growing above this share of its quota counts as near
    # Heading for it: over the quota within this many base periods at the rate seen over the
    # last one (a lower bound: the growth may have come at the end of it).
    horizon_periods: float = 4.0
    hold_s: float = 1.0  # the short period lasts this long after the last sign of growth

    @property
    def adaptive(self) -> bool:
        return 0 < self.near_s < self.base_s


@dataclass(frozen=True)
class Usage:
    used_bytes: int
    quota_bytes: int


class CheckCadence:
    """Remembers each container's last use and says when to check next."""

    def __init__(self, settings: CadenceSettings) -> None:
        self.settings = settings
        self._last: dict[str, tuple[float, int]] = {}  # key -> (time, used bytes) at the last check
        self._fast_until: dict[str, float] = {}  # key -> time its short period ends

    def after_check(self, now: float, usage: Mapping[str, Usage], *, partial: bool = False) -> float:
        """Record one check's use per container (with a quota); returns the seconds until the
        next check. ``partial``: the check covered only some containers (the others are
        not forgotten)."""
        s = self.settings
        for key, use in usage.items():
            last = self._last.get(key)
            # Not seen before: it held nothing at the last check and may have started just
            # now, so its rate is unknown (taken as fast): any memory at all makes it near.
            since, before = last if last is not None else (now, 0)
            self._last[key] = (now, use.used_bytes)
            if s.adaptive and self._near(use, use.used_bytes - before, now - since):
                self._fast_until[key] = now + s.hold_s
        for key in [k for k in self._last if k not in usage and not partial]:
            del self._last[key]
            self._fast_until.pop(key, None)
        for key in [k for k, until in self._fast_until.items() if until <= now]:
            del self._fast_until[key]
        return s.near_s if self._fast_until else s.base_s

    def fast(self) -> list[str]:
        """The containers checked at the short period now (status, tests)."""
        return sorted(self._fast_until)

    def _near(self, use: Usage, grown: int, elapsed: float) -> bool:
        s = self.settings
        if grown <= 0 or use.quota_bytes <= 0 or use.used_bytes > use.quota_bytes:
            return False  # still, shrinking, no quota, or over already (the guard acts on it)
        if use.used_bytes >= s.near_fraction * use.quota_bytes:
            return True
        if elapsed <= 0:
            return True
        rate = grown / elapsed
        return use.used_bytes + rate * s.horizon_periods * s.base_s > use.quota_bytes
