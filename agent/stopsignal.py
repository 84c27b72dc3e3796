"""The agent's stop flag: a :class:`threading.Event` that also wakes the loops that sleep on
their own condition, queue or socket.

A loop that waits for its work with a short timeout only to look at the stop flag wakes
every time the timeout ends, work or not. On a VM each wakeup is a timer exit that costs
20-60 us of CPU, and a dozen such loops were about a quarter of an idle agent's CPU. With
:func:`on_stop` a loop registers how to wake it (notify its condition, put a sentinel in
its queue, shut its socket) and then waits for its work alone.

Loops are also run with a plain :class:`threading.Event` (tests, tools). There
:func:`on_stop` registers nothing and says so, and the loop keeps its polling timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Cancel = Callable[[], None]


class StopSignal(threading.Event):
    """An Event whose :meth:`set` also runs the callbacks registered with :meth:`on_set`."""

    def __init__(self) -> None:
        super().__init__()
        self._guard = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._next_token = 0

    def on_set(self, callback: Callable[[], object]) -> Cancel:
        """Run ``callback`` once when the flag is set (in the setting thread), or now if it is
        set already; returns a function that cancels it (a no-op once it ran)."""
        with self._guard:
            if not self.is_set():
                token = self._next_token
                self._next_token += 1
                self._callbacks[token] = callback
                return lambda: self._cancel(token)
        _run(callback)
        return _nothing

    def set(self) -> None:
        with self._guard:
            super().set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            _run(callback)

    def waiting(self) -> int:
        """How many callbacks wait for the flag (tests: a loop that ended cancelled its own)."""
        with self._guard:
            return len(self._callbacks)

    def _cancel(self, token: int) -> None:
        with self._guard:
            self._callbacks.pop(token, None)


def on_stop(stop: threading.Event, callback: Callable[[], object]) -> Cancel | None:
    """Register ``callback`` to run when ``stop`` is set: a cancel function, or None where
    ``stop`` is a plain Event (the caller must keep looking at it with a timeout)."""
    if isinstance(stop, StopSignal):
        return stop.on_set(callback)
    return None


def notifier(condition: threading.Condition) -> Callable[[], None]:
    """A callback that wakes every thread waiting on ``condition``. The waiter must look at
    the stop flag with ``condition`` held before it waits, or the wakeup can come between."""

    def wake() -> None:
        with condition:
            condition.notify_all()

    return wake


def _run(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # a loop's wake-up must not keep the others from theirs
        log.exception("a stop callback failed")


def _nothing() -> None:
    return None
