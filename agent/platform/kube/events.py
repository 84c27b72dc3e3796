"""Kubernetes Events (core/v1) about pods and this node, posted in the background.

``pod()`` and ``node()`` only queue (the Allocate path calls them and must not wait on
the API); ``run()`` posts. The same (object, type, reason, message) again within
``aggregate_window_s`` of its last occurrence PATCHes ``count`` and ``lastTimestamp`` of
the event already posted instead of creating another, as client-go's correlator does.
Failures are logged and the event is dropped: events are best effort, never a reason to
fail a caller. A full queue drops new events (counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api, CoreV1Event

from agent.clock import Clock, SystemClock
from agent.errors import KubeError
from agent.platform.kube.client import json_call
from agent.platform.kube.pods import PodInfo
from agent.stopsignal import notifier, on_stop

log = logging.getLogger(__name__)

_MERGE_PATCH = "application/merge-patch+json"
_RECENT = 4096  # posted events remembered for aggregation (client-go's cache size)
_MAX_MESSAGE = 1024
_POLL_S = 0.2  # how often an idle run() looks at a plain stop event (a StopSignal wakes it)


@dataclass(frozen=True)
class _Subject:
    kind: str
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class _Request:
    subject: _Subject
    type: str  # Warning | Normal
    reason: str
    message: str
    wall: float

    @property
    def key(self) -> tuple[object, ...]:
        return (self.subject, self.type, self.reason, self.message)

    def __str__(self) -> str:
        return f"{self.reason} on {self.subject.kind} {self.subject.namespace}/{self.subject.name}"


@dataclass
class _Posted:
    name: str
    namespace: str
    count: int
    last: float  # clock.monotonic() of the last occurrence


@dataclass
class EventStats:
    created: int = 0
    aggregated: int = 0  # occurrences recorded by PATCHing an existing event
    dropped: int = 0  # queue full
    failed: int = 0  # the API refused or did not answer


class EventRecorder:
    """Non-blocking event recording with aggregation (see the module docstring)."""

    def __init__(
        self,
        api: ApiClient,
        node_name: str,
        component: str = "vcuda-agent",
        clock: Clock | None = None,
        *,
        max_queue: int = 1000,
        aggregate_window_s: float = 600.0,
        request_timeout_s: float = 10.0,
    ) -> None:
        self.node_name = node_name
        self.component = component
        self._core = CoreV1Api(api)
        self._clock = clock or SystemClock()
        self._max_queue = max_queue
        self._window_s = aggregate_window_s
        self._timeout = request_timeout_s
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._busy = 0  # requests taken off the queue and not yet posted
        self._recent: OrderedDict[tuple[object, ...], _Posted] = OrderedDict()
        self._last_ns = 0  # event names must be unique even when the clock stands still
        self.stats = EventStats()

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        """Queue an event about ``pod``; returns at once."""
        self._enqueue(_Subject("Pod", pod.namespace, pod.name, pod.uid), reason, message, warning)

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        """Queue an event about this node (in namespace default, uid = node name, as kubelet does)."""
        self._enqueue(_Subject("Node", "default", self.node_name, self.node_name), reason, message, warning)

    def run(self, stop: threading.Event) -> None:
        """Post queued events until ``stop`` is set."""
        cancel = on_stop(stop, notifier(self._cond))
        poll = None if cancel is not None else _POLL_S  # woken by the stop flag, or looking at it
        try:
            while True:
                with self._cond:
                    if stop.is_set():
                        return
                    if not self._queue:
                        self._cond.wait(poll)
                        continue
                    request = self._queue.popleft()
                    self._busy += 1
                self._post_one(request)
        finally:
            if cancel is not None:
                cancel()

    def _post_one(self, request: _Request) -> None:
        try:
            self._post(request)
        except KubeError as err:
            self.stats.failed += 1
            log.warning("could not record event %s: %s", request, err)
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait (real time) until every queued event has been posted or dropped."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _enqueue(self, subject: _Subject, reason: str, message: str, warning: bool) -> None:
        kind = "Warning" if warning else "Normal"
        request = _Request(subject, kind, reason, message[:_MAX_MESSAGE], self._clock.wall())
        with self._cond:
            if len(self._queue) >= self._max_queue:
                self.stats.dropped += 1
                log.warning("event queue full (%d); dropping event %s", self._max_queue, request)
                return
            self._queue.append(request)
            self._cond.notify_all()

    def _post(self, request: _Request) -> None:
        stamp = _timestamp(request.wall)
        prior = self._recent.get(request.key)
        recent = prior is not None and self._clock.monotonic() - prior.last < self._window_s
        if prior is not None and recent and self._aggregate(prior, stamp):
            self._recent.move_to_end(request.key)
            return
        self._last_ns = max(int(request.wall * 1e9), self._last_ns + 1)
        event = CoreV1Event.model_validate(self._event(request, stamp, self._last_ns))
        namespace = request.subject.namespace
        json_call(
            f"create event {request}",
            lambda: self._core.create_namespaced_event(
                namespace, event, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        self.stats.created += 1
        self._recent[request.key] = _Posted(str(event.metadata.name), namespace, 1, self._clock.monotonic())
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _aggregate(self, prior: _Posted, stamp: str) -> bool:
        """PATCH count and lastTimestamp; False when the event is gone (expired on the server)."""
        patch = {"count": prior.count + 1, "lastTimestamp": stamp}
        try:
            json_call(
                f"update event {prior.namespace}/{prior.name}",
                lambda: self._core.patch_namespaced_event(
                    prior.name,
                    prior.namespace,
                    patch,
                    _content_type=_MERGE_PATCH,
                    _preload_content=False,
                    _request_timeout=self._timeout,
                ),
            )
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        prior.count += 1
        prior.last = self._clock.monotonic()
        self.stats.aggregated += 1
        return True

    def _event(self, request: _Request, stamp: str, nanos: int) -> dict[str, Any]:
        subject = request.subject
        involved = {"apiVersion": "v1", "kind": subject.kind, "name": subject.name, "uid": subject.uid}
        if subject.kind == "Pod":
            involved["namespace"] = subject.namespace
        return {
            "apiVersion": "v1",
            "kind": "Event",
            # client-go's naming: <object>.<unix nanoseconds in hex>
            "metadata": {"name": f"{subject.name}.{nanos:x}", "namespace": subject.namespace},
            "involvedObject": involved,
            "reason": request.reason,
            "message": request.message,
            "type": request.type,
            "source": {"component": self.component, "host": self.node_name},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": self.component,
            "reportingInstance": self.node_name,
        }


def _timestamp(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
