"""The NVIDIA_VISIBLE_DEVICES hole's verdict for status and metrics, kept fresh.

The toolkit's config can be edited while the agent runs (an admin closing the hole), so it
is read again once ``interval_s`` has passed since the last read, on the next question:
status and scrapes ask often, the file changes rarely. Each change of verdict is logged
once (a warning while it is open or unknown).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.domain.visibledevices import HoleState, HoleVerdict, envvar_hole
from agent.platform.toolkitconfig import ToolkitConfigFile, read_toolkit_config

log = logging.getLogger(__name__)


class VisibleDevicesCheck:
    def __init__(
        self,
        paths: Sequence[Path],
        strategy: str,
        *,
        clock: Clock | None = None,
        interval_s: float = 30.0,
        reader: Callable[[Path], ToolkitConfigFile] = read_toolkit_config,
    ) -> None:
        self.paths = tuple(paths)
        self.strategy = strategy
        self._clock = clock or SystemClock()
        self._interval_s = interval_s
        self._reader = reader
        self._lock = threading.Lock()
        self._verdict: HoleVerdict | None = None
        self._read_at = 0.0

    def verdict(self) -> HoleVerdict:
        with self._lock:
            now = self._clock.monotonic()
            if self._verdict is None or now - self._read_at >= self._interval_s:
                fresh = envvar_hole([self._reader(p) for p in self.paths], self.strategy)
                if fresh != self._verdict:
                    level = logging.INFO if fresh.state is HoleState.CLOSED else logging.WARNING
                    log.log(level, "NVIDIA_VISIBLE_DEVICES hole %s: %s", fresh.state, fresh.detail)
                self._verdict, self._read_at = fresh, now
            return self._verdict
