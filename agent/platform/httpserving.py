"""Socket servers that sleep until a connection comes or they are shut down.

``socketserver``'s ``serve_forever`` wakes every ``poll_interval`` to look at its shutdown
flag. The agent serves /metrics and its status socket all day, and on a VM each of those
wakeups is a timer exit (20-60 us of CPU, ten a second per server at the 0.1 s that makes a
stop prompt). :class:`QuietServing` waits on the listening socket and on a pipe that
:meth:`~QuietServing.shutdown` writes to, with no timeout at all.
"""

from __future__ import annotations

import os
import selectors
import socketserver
import threading
from typing import Any

from agent.platform.threadname import set_native_name


class QuietServing(socketserver.TCPServer):
    """Put first in a server's bases: ``class S(QuietServing, ThreadingHTTPServer)``.

    ``serve_forever`` and ``shutdown`` keep their contract: ``shutdown`` (from another
    thread) returns once the loop has ended, and returns at once when it never ran."""

    # handle_request() is called only once the socket is readable: it must not wait again
    # (a client that connected and reset before the accept leaves nothing to accept).
    timeout: float | None = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = threading.Event()
        self._serving = threading.Event()
        self._stopped = threading.Event()
        self._pipe_closed = False
        super().__init__(*args, **kwargs)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Handle requests until :meth:`shutdown`; ``poll_interval`` is ignored (nothing polls)."""
        set_native_name(threading.current_thread().name)  # per-thread CPU and wakeups name it
        self._serving.set()
        try:
            if self._stopping.is_set():
                return
            with selectors.DefaultSelector() as selector:
                selector.register(self.fileno(), selectors.EVENT_READ)
                selector.register(self._wake_read, selectors.EVENT_READ)
                while not self._stopping.is_set():
                    ready = selector.select()
                    if self._stopping.is_set():
                        return
                    if any(key.fd != self._wake_read for key, _ in ready):
                        self.handle_request()
                    self.service_actions()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        if not self._stopping.is_set():
            self._stopping.set()
            os.write(self._wake_write, b"\0")
        if self._serving.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        if not self._pipe_closed:  # once: a number closed twice may be another file's by then
            self._pipe_closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
