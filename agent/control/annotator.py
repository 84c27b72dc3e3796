"""Writes pod annotations off the Allocate path: Allocate records the ledger at once and
queues the PATCH here, so kubelet never waits on the API server. Failed writes are
retried with back-off; a pod that is gone (404) is dropped.

While the API server does not answer, or answers 429 or 5xx (an outage, a restart, an
overloaded server), a write is retried until it lands, however long that takes: giving up
would lose an assignment the extender reads from these annotations. Writes queue behind it
meanwhile; all of them wait for the same server. Other refusals (a 4xx: forbidden, invalid)
are given up after ``max_attempts``. A run of failures is logged as one WARNING and one INFO
when writes land again; the tries in between are DEBUG. Writes still queued when the agent
dies are re-derived from the ledger at the next start (``LedgerRecovery.reannotate``)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from agent.clock import Clock, SystemClock
from agent.errors import KubeError
from agent.platform.kube.pods import PodInfo
from agent.stopsignal import on_stop

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often an idle run() looks at a plain stop event (a StopSignal wakes it)


class AnnotationPatcher(Protocol):
    def patch_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> PodInfo: ...


@dataclass
class _Write:
    namespace: str
    name: str
    annotations: dict[str, str | None]
    attempts: int = 0


class Annotator:
    def __init__(
        self,
        writer: AnnotationPatcher,
        clock: Clock | None = None,
        max_attempts: int = 8,
        max_backoff_s: float = 10.0,
    ) -> None:
        self._writer = writer
        self._clock = clock or SystemClock()
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=10_000)
        self._max_attempts = max_attempts
        self._max_backoff_s = max_backoff_s
        self._idle = threading.Condition()
        self._busy = 0
        self.written = 0
        self.failed = 0
        self._failing = 0  # failed tries since the last write that landed (the worker's thread)

    def submit(self, pod: PodInfo, annotations: Mapping[str, str | None]) -> None:
        with self._idle:
            self._busy += 1
        try:
            self._queue.put_nowait(_Write(pod.namespace, pod.name, dict(annotations)))
        except queue.Full:
            self._done()
            self.failed += 1
            log.error("annotation queue full: dropped %s for pod %s", sorted(annotations), pod.key)

    def pending(self) -> int:
        with self._idle:
            return self._busy

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted write finished (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout=timeout_s)

    def run(self, stop: threading.Event) -> None:
        cancel = on_stop(stop, self._wake)
        poll = None if cancel is not None else _POLL_S  # woken by the stop flag, or looking at it
        try:
            while not stop.is_set():
                try:
                    write = self._queue.get(timeout=poll)
                except queue.Empty:
                    continue
                if write is not None:  # None: the stop flag's wake-up
                    self._attempt(write, stop)
        finally:
            if cancel is not None:
                cancel()

    def _wake(self) -> None:
        with contextlib.suppress(queue.Full):  # full: the loop has writes to take, it is not waiting
            self._queue.put_nowait(None)

    def _attempt(self, write: _Write, stop: threading.Event) -> None:
        backoff = 0.2
        where = f"{write.namespace}/{write.name}"
        while True:
            write.attempts += 1
            try:
                self._writer.patch_annotations(write.namespace, write.name, write.annotations)
            except KubeError as err:
                if err.status == 404:
                    log.info("pod %s is gone; dropped its annotation update", where)
                    break
                if stop.is_set() or (not _transient(err) and write.attempts >= self._max_attempts):
                    self.failed += 1
                    log.error("gave up annotating pod %s after %d tries: %s", where, write.attempts, err)
                    break
                self._failing += 1
                if self._failing == 1 or not _transient(err):
                    log.warning(
                        "annotating pod %s failed (try %d): %s; retrying%s",
                        where,
                        write.attempts,
                        err,
                        " until the API server answers" if _transient(err) else "",
                    )
                else:
                    log.debug("annotating pod %s failed (try %d): %s", where, write.attempts, err)
                if self._clock.sleep(backoff, stop):
                    break
                backoff = min(self._max_backoff_s, backoff * 2)
                continue
            if self._failing:
                log.info(
                    "annotations are written again (pod %s, after %d failed tries)", where, self._failing
                )
                self._failing = 0
            self.written += 1
            break
        self._done()

    def _done(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()


def _transient(err: KubeError) -> bool:
    """No answer, throttled or a server-side failure: the same write will work later."""
    return err.status is None or err.status == 429 or err.status >= 500
