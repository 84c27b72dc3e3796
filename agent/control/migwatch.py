"""The node's MIG inventory: every GPU's MIG mode (current and pending) and MIG devices, read
from the backend at start and every ``refresh_s`` after, for the node publisher (annotation,
labels), the status document and the metrics.

Read-only: nothing here changes a GPU. A GPU whose read fails keeps its last known state
(logged once per run of failures); a GPU never read is reported without MIG. When a GPU's
instances go, their health records go with them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from agent.clock import Clock, SystemClock
from agent.control.retrylog import RetryLog
from agent.domain.health import HealthBoard
from agent.errors import GpuError
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.gpu.migstate import NOT_CAPABLE, MigInfo
from agent.settings import MIG_REFRESH_S

log = logging.getLogger(__name__)


class MigWatch:
    """MIG state per GPU index with a version that grows on each change."""

    def __init__(
        self,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        board: HealthBoard | None = None,
        *,
        refresh_s: float = MIG_REFRESH_S,
        clock: Clock | None = None,
    ) -> None:
        self._backend = backend
        self._indexes = [g.index for g in gpus]
        self._board = board
        self._refresh_s = refresh_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._state: dict[int, MigInfo] = dict.fromkeys(self._indexes, NOT_CAPABLE)
        self._version = 0
        self._retry = {
            i: RetryLog(log, f"GPU {i}: cannot read its MIG state", f"GPU {i}: its MIG state reads again")
            for i in self._indexes
        }

    def snapshot(self) -> tuple[int, Mapping[int, MigInfo]]:
        with self._lock:
            return self._version, dict(self._state)

    def refresh(self) -> bool:
        """Read every GPU once; True when anything changed."""
        changed = False
        for index in self._indexes:
            try:
                info = self._backend.mig(index)
            except GpuError as err:
                self._retry[index].failed(str(err))
                continue
            self._retry[index].succeeded()
            with self._lock:
                if self._state.get(index) == info:
                    continue
                before = self._state.get(index, NOT_CAPABLE)
                self._state[index] = info
                self._version += 1
            changed = True
            _log_change(index, before, info)
            if self._board is not None:
                self._board.clear_instances(index, keep={d.gi for d in info.devices})
        return changed

    def run(self, stop: threading.Event) -> None:
        while not self._clock.sleep(self._refresh_s, stop):
            self.refresh()


def _log_change(index: int, before: MigInfo, info: MigInfo) -> None:
    if not info.capable:
        return
    mode = "enabled" if info.current else "disabled"
    after = "enabled" if info.pending else "disabled"
    pending = f", {after} after a GPU reset" if info.change_pending else ""
    devices = ", ".join(f"{d.profile} (GI {d.gi} CI {d.ci}, {d.uuid})" for d in info.devices) or "none"
    if (before.current, before.pending) != (info.current, info.pending) or not before.capable:
        log.info("GPU %d: MIG mode %s%s", index, mode, pending)
    if before.devices != info.devices:
        log.info("GPU %d: MIG devices: %s", index, devices)
