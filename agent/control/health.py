"""The health loop: backend events → policy → health board (→ ListAndWatch); an XID of a MIG
GPU instance marks that instance, not its GPU."""

from __future__ import annotations

import logging
import threading

from agent.domain.health import HealthBoard, HealthPolicy
from agent.platform.gpu.inventory import EventKind, GpuBackend

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self, backend: GpuBackend, policy: HealthPolicy, board: HealthBoard, wait_s: float = 0.5
    ) -> None:
        self._backend = backend
        self._policy = policy
        self._board = board
        self._wait_s = wait_s

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for event in self._backend.wait_events(self._wait_s):
                if event.xid is not None:
                    self._board.xids.record(event.gpu_index, event.xid)
                verdict = self._policy.verdict(event)
                if verdict is None:
                    log.info(
                        "GPU %d: XID %s ignored by policy (%s)",
                        event.gpu_index,
                        event.xid,
                        event.detail,
                    )
                    continue
                healthy, reason = verdict
                state = "Healthy" if healthy else "Unhealthy"
                if event.gpu_instance is not None:  # a MIG instance's XID: that instance only
                    if self._board.set_instance(event.gpu_index, event.gpu_instance, healthy, reason):
                        log.warning(
                            "GPU %d GPU instance %d is now %s: %s",
                            event.gpu_index,
                            event.gpu_instance,
                            state,
                            reason,
                        )
                    continue
                if event.kind is EventKind.RECOVERED:
                    self._board.clear_instances(event.gpu_index)  # a reset: its instances start anew
                if self._board.set(event.gpu_index, healthy, reason):
                    log.warning("GPU %d is now %s: %s", event.gpu_index, state, reason)
