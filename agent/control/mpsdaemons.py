"""The node's MPS control daemons, one per GPU, kept as long as the GPU holds shares.

A GPU's daemon is started at its first share (by the caller, at Allocate), restarted when
it dies while the GPU holds shares, and stopped after ``idle_stop_s`` without any. At start
the daemons a previous agent left running are adopted. The caller serialises the calls
(:class:`~agent.control.mpssharing.MpsSharing` holds its lock around them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.errors import MpsUnavailableError
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
        self._idle_stop_s = idle_stop_s
        self._shares_on = shares_on
        self._report = report
        self._idle_since: dict[int, float] = {}

    def __getitem__(self, gpu: int) -> MpsDaemon:
        return self.daemons[gpu]

    def in_use(self, gpu: int) -> None:
        """A share is being placed on ``gpu``: its daemon is not idle."""
        self._idle_since.pop(gpu, None)

    def resume(self, now: float, *, start_missing: bool) -> None:
        """Adopt the daemons a previous agent left running (whatever the mode: the ticks stop
        those of idle GPUs); with ``start_missing``, start those of GPUs that still hold
        shares (theirs died while no agent watched)."""
        for index, daemon in self.daemons.items():
            if daemon.adopt_recorded() or not start_missing or self._shares_on is None:
                continue
            if self._shares_on(index) > 0:
                self._ensure(index, daemon, now)

    def tick(self, now: float) -> None:
        """Restart dead daemons; stop those whose GPU has held no share for idle_stop_s."""
        for index, daemon in self.daemons.items():
            if daemon.state in (DaemonState.STOPPED, DaemonState.FAILED):
                continue
            if self._shares_on is not None and self._shares_on(index) == 0:
                since = self._idle_since.setdefault(index, now)
                if now - since >= self._idle_stop_s:
                    log.info("GPU %d holds no share: stopping its MPS control daemon", index)
                    daemon.stop()
                    self._idle_since.pop(index, None)
                    continue
            else:
                self._idle_since.pop(index, None)
            self._ensure(index, daemon, now)

    def statuses(self) -> list[DaemonStatus]:
        return [d.status() for d in self.daemons.values()]

    def _ensure(self, index: int, daemon: MpsDaemon, now: float) -> None:
        try:
            daemon.ensure(now)
        except MpsUnavailableError as err:
            self._report(f"GPU {index}: no MPS ({err})")
