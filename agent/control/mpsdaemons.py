"""The node's MPS control daemons, one per GPU, kept as long as the GPU holds shares.

A GPU's daemon is started at its first share (by the caller, at Allocate), restarted when
it dies while the GPU holds shares, and stopped after ``idle_stop_s`` without any. At start
the daemons a previous agent left running are adopted.

Each GPU has its own lock (:meth:`DaemonPool.lock`), held around every call on its daemon
and every v3 command sent to it, and only there: a start, a stop or an Allocate's wait on
one GPU holds up nothing on another, and the control loop takes none of them (it reads the
sharing layer's published view, :mod:`.mpsview`). A tick skips a GPU whose lock an Allocate
holds (that Allocate is seeing to its daemon); the next tick comes a second later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.errors import PlatformError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.mpsdaemon import DaemonState, DaemonStatus, MpsDaemon

log = logging.getLogger(__name__)


class DaemonPool:
    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        command: Sequence[str],
        root: Path,
        *,
        idle_stop_s: float,
        shares_on: Callable[[int], int] | None,
        report: Callable[[str], None],
    ) -> None:
        """``shares_on(gpu)``: how many shares the GPU holds now (None: unknown, so a daemon
        is never stopped for idleness nor restarted at resume); ``report``: where a daemon
        that cannot run is told (once per message)."""
        self.daemons = {g.index: MpsDaemon(g.index, g.uuid, list(command), root) for g in gpus}
        self._locks = {g.index: threading.Lock() for g in gpus}
        self._spare = threading.Lock()  # for a grant recorded on a GPU this node no longer has
        self._idle_stop_s = idle_stop_s
        self._shares_on = shares_on
        self._report = report
        # Per GPU (every key there from the start): since when it holds no share; None: it holds some.
        self._idle_since: dict[int, float | None] = dict.fromkeys(self.daemons)

    def __getitem__(self, gpu: int) -> MpsDaemon:
        return self.daemons[gpu]

    def lock(self, gpu: int) -> threading.Lock:
        """The lock held around every call on ``gpu``'s daemon (see the module docstring)."""
        return self._locks.get(gpu, self._spare)

    def in_use(self, gpu: int) -> None:
        """A share is being placed on ``gpu``: its daemon is not idle (the caller holds its lock)."""
        self._idle_since[gpu] = None

    def resume(self, now: float, *, start_missing: bool) -> None:
        """Adopt the daemons a previous agent left running (whatever the mode: the ticks stop
        those no longer wanted); with ``start_missing``, also start those of GPUs that hold
        shares (theirs died while no agent watched)."""
        for index, daemon in self.daemons.items():
            with self._locks[index]:
                if daemon.adopt_recorded() or not start_missing or self._shares_on is None:
                    continue
                if self._shares_on(index) > 0:
                    self._ensure(index, daemon, now)

    def tick(self, now: float) -> None:
        """Restart dead daemons; stop those whose GPU has held no share for idle_stop_s."""
        for index, daemon in self.daemons.items():
            lock = self._locks[index]
            if not lock.acquire(blocking=False):
                continue  # an Allocate is seeing to this daemon now
            try:
                self._tick(index, daemon, now)
            finally:
                lock.release()

    def _tick(self, index: int, daemon: MpsDaemon, now: float) -> None:
        if daemon.state in (DaemonState.STOPPED, DaemonState.FAILED):
            return
        if self._shares_on is not None and self._shares_on(index) == 0:
            since = self._idle_since[index]
            if since is None:
                since = self._idle_since[index] = now
            if now - since >= self._idle_stop_s:
                log.info("GPU %d holds no share: stopping its MPS control daemon", index)
                self._idle_since[index] = None
                try:
                    daemon.stop()
                except PlatformError as err:
                    self._report(f"GPU {index}: the MPS control daemon was not stopped ({err})")
                return
        else:
            self._idle_since[index] = None
        self._ensure(index, daemon, now)

    def statuses(self) -> list[DaemonStatus]:
        return [d.status() for d in self.daemons.values()]

    def _ensure(self, index: int, daemon: MpsDaemon, now: float) -> None:
        try:
            daemon.ensure(now)
        except PlatformError as err:
            self._report(f"GPU {index}: no MPS ({err})")
