"""The main thread waits for the agent's signals with no timeout.

The kernel hands a signal sent to the process to any of its threads that does not block
it. Python runs the signal's handler in the main thread, and only when that thread next
runs Python code: a main thread asleep in a lock (``Event.wait()`` with no timeout) sleeps
on when the kernel picked another thread, and the agent ignores SIGTERM. A loop that wakes
every 0.2 s to look does not have that problem, but it wakes five times a second for
nothing. The C-level handler writes the signal's number to the wakeup fd
(``signal.set_wakeup_fd``) in whatever thread it ran, so the main thread sleeps in
``select`` on that fd and reads which signals came.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Iterable
from types import FrameType


class SignalWaiter:
    """Takes over ``signals`` (built in the main thread) until :meth:`close`."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._signals = frozenset(int(s) for s in signals)
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._handlers = {s: signal.signal(s, _noted) for s in self._signals}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def wait(self, timeout_s: float | None = None) -> list[signal.Signals]:
        """The signals that came, in order, once at least one did (``[]`` after ``timeout_s``).
        Signals of other handlers that share the wakeup fd are left out."""
        while True:
            readable, _, _ = select.select([self._read], [], [], timeout_s)
            if not readable:
                return []
            try:
                data = os.read(self._read, 512)
            except BlockingIOError:  # read by an earlier call meanwhile
                data = b""
            came = [signal.Signals(n) for n in data if n in self._signals]
            if came or timeout_s is not None:
                return came

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._handlers.items():
            if handler is not None:  # None: not set from Python; nothing to put back
                signal.signal(signum, handler)
        os.close(self._read)
        os.close(self._write)


def _noted(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler: it only keeps the default action (exit) away; the number
    reached the wakeup fd before it ran."""
    return None
