"""Time behind one small interface, so control loops can run in virtual time in tests."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        """Sleep; return True early if ``stop`` is set."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        if stop is None:
            time.sleep(max(0.0, seconds))
            return False
        return stop.wait(max(0.0, seconds))


class VirtualClock:
    """A clock that only moves when something sleeps on it (tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        return self.monotonic()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        if stop is not None and stop.is_set():
            return True
        self.advance(max(0.0, seconds))
        return stop.is_set() if stop is not None else False
