"""The pods bound to this node (``spec.nodeName=<node>``), kept current by a list+watch.

How the cache never serves data more than one re-list old: its content is always the
last consistent LIST (no resourceVersion: the server's current state, never a cached
older one) plus every watch event after it, in order. A watch that ends or drops is
resumed from the last resourceVersion (events and BOOKMARKs advance it), so the server
replays what happened meanwhile and nothing is skipped; when the server can no longer
replay (410 Gone) the cache is rebuilt from a new LIST, and pods that vanished in between
get a DELETED. While the API cannot be reached the cache keeps the last state it knew and
``stats().staleness_s`` (time since the last list, event or bookmark) says how old it is.

Our own PATCH results are written through with ``apply_local`` (ignored when older than
what the cache has), so an Allocate sees its own annotations without waiting for the watch;
a written-through pod that a later LIST lacks (and that is not newer than it) is deleted
then, so write-through cannot leave a pod behind that the API no longer has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api

from agent.clock import Clock, SystemClock
from agent.errors import PodFormatError
from agent.platform.kube.pods import PodInfo, pod_from_json
from agent.platform.kube.reflector import Reflector

log = logging.getLogger(__name__)

# fn(event_type "ADDED" | "MODIFIED" | "DELETED", old, new)
Subscriber = Callable[[str, PodInfo | None, PodInfo | None], None]
_TOMBSTONES = 4096  # deleted uids remembered, so a late apply_local cannot resurrect a pod


@dataclass(frozen=True)
class PodCacheStats:
    synced: bool
    staleness_s: float | None  # None before the first list
    pods: int
    lists: int
    relists: int  # re-lists after 410 Gone
    watch_restarts: int
    errors: int
    skipped: int  # pods whose JSON could not be parsed


class PodCache:
    """A list+watch cache of this node's pods, as ``PodInfo`` by uid (see the module docstring)."""

    def __init__(
        self,
        api: ApiClient,
        node_name: str,
        clock: Clock | None = None,
        *,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        watch_timeout_s: float = 300.0,
    ) -> None:
        self.node_name = node_name
        self._clock = clock or SystemClock()
        self._reflector = Reflector(
            CoreV1Api(api).list_pod_for_all_namespaces,
            self._on_event,
            what=f"pods on node {node_name}",
            field_selector=f"spec.nodeName={node_name}",
            clock=self._clock,
            on_synced=self._on_synced,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            watch_timeout_s=watch_timeout_s,
        )
        self._lock = threading.Lock()  # guards the maps; never held while calling out
        self._changed = threading.Condition(self._lock)
        self._writing = threading.RLock()  # one writer at a time, notifications in order
        self._pods: dict[str, PodInfo] = {}
        self._version = 0
        self._synced = False
        self._subscribers: list[Subscriber] = []
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._bad: set[str] = set()  # uids whose parse failure was logged

    def run(self, stop: threading.Event) -> None:
        """List and watch until ``stop`` is set (run it under the Supervisor)."""
        self._reflector.run(stop)

    def wait_synced(self, timeout_s: float) -> bool:
        return self.wait_for(lambda: self._synced, timeout_s)

    def pods(self) -> list[PodInfo]:
        """A snapshot of every cached pod (PodInfo is immutable)."""
        with self._lock:
            return list(self._pods.values())

    def snapshot(self) -> tuple[int, list[PodInfo]]:
        """(version, pods): the version changes whenever the cache does, so callers can keep
        views derived from an unchanged snapshot."""
        with self._lock:
            return self._version, list(self._pods.values())

    def version(self) -> int:
        """The snapshot's version alone (a reader that keeps a view of the pods asks it
        several times a second: the list is not copied)."""
        with self._lock:
            return self._version

    def get(self, uid: str) -> PodInfo | None:
        with self._lock:
            return self._pods.get(uid)

    def find(self, namespace: str, name: str) -> PodInfo | None:
        with self._lock:
            return next((p for p in self._pods.values() if p.name == name and p.namespace == namespace), None)

    def subscribe(self, fn: Subscriber) -> None:
        """Call ``fn`` on every change, in order, outside the cache's lock, from the thread that
        made the change (the watch thread, or the caller of ``apply_local``). It must not block."""
        with self._writing:
            self._subscribers.append(fn)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (real time) until ``predicate()`` holds; it is re-checked on every change."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                version = self._version
            if predicate():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._changed:
                if self._version == version:
                    self._changed.wait(remaining)

    def apply_local(self, pod: PodInfo) -> None:
        """Write through the result of our own PATCH; ignored when the cache already has this
        or a newer resourceVersion, for a deleted pod, or for a pod on another node."""
        if pod.node_name != self.node_name:
            return
        with self._writing:
            with self._lock:
                old = self._pods.get(pod.uid)
                if pod.uid in self._tombstones or (old is not None and not _newer(pod, old)):
                    return
                self._store(pod)
            self._notify("MODIFIED" if old is not None else "ADDED", old, pod)

    def stats(self) -> PodCacheStats:
        reflector = self._reflector.stats
        last = reflector.last_sync
        with self._lock:
            count, skipped = len(self._pods), len(self._bad)
        return PodCacheStats(
            synced=reflector.synced,
            staleness_s=None if last is None else max(0.0, self._clock.monotonic() - last),
            pods=count,
            lists=reflector.lists,
            relists=reflector.relists_410,
            watch_restarts=reflector.watch_restarts,
            errors=reflector.errors,
            skipped=skipped,
        )

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if kind == "DELETED":
            self._delete(uid)
            return
        try:
            pod = pod_from_json(obj)
        except (PodFormatError, ValueError, TypeError, AttributeError, KeyError) as err:
            # pod_from_json reports missing fields; fields of the wrong JSON type fail inside it.
            self._skip(uid, obj, err)
            return
        with self._writing:
            with self._lock:
                self._bad.discard(uid)
                old = self._pods.get(pod.uid)
                if old is not None and not _newer(pod, old):
                    return
                self._store(pod)
            self._notify("ADDED" if old is None else "MODIFIED", old, pod)

    def _on_synced(self) -> None:
        # A pod written through by apply_local that this list (or a later event) does not
        # have is gone, unless it is newer than the list.
        listed = {str((o.get("metadata") or {}).get("uid")) for o in self._reflector.objects()}
        list_rv = self._reflector.stats.resource_version
        with self._lock:
            self._synced = True
            self._bump()
            ghosts = [
                p.uid
                for p in self._pods.values()
                if p.uid not in listed and not _newer_than(p.resource_version, list_rv)
            ]
        for uid in ghosts:
            self._delete(uid)

    def _delete(self, uid: str) -> None:
        with self._writing:
            with self._lock:
                old = self._pods.pop(uid, None)
                self._bad.discard(uid)
                self._tombstones[uid] = None
                while len(self._tombstones) > _TOMBSTONES:
                    self._tombstones.popitem(last=False)
                self._bump()
            if old is not None:
                self._notify("DELETED", old, None)

    def _store(self, pod: PodInfo) -> None:
        # Caller holds the lock.
        self._pods[pod.uid] = pod
        self._bump()

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _skip(self, uid: str, obj: dict[str, Any], err: Exception) -> None:
        with self._lock:
            first = uid not in self._bad
            self._bad.add(uid)
        if first:  # once per pod, not once per event
            meta = obj.get("metadata") or {}
            log.warning(
                "skipping pod %s/%s (uid %s) on node %s: %s",
                meta.get("namespace"), meta.get("name"), uid or "?", self.node_name, err,
            )  # fmt: skip

    def _notify(self, kind: str, old: PodInfo | None, new: PodInfo | None) -> None:
        for fn in list(self._subscribers):
            try:
                fn(kind, old, new)
            except Exception:  # a subscriber's bug must not stop the watch
                log.exception("pod cache subscriber %r failed on %s", fn, kind)


def _newer(new: PodInfo, old: PodInfo) -> bool:
    return _newer_than(new.resource_version, old.resource_version)


def _newer_than(new: str, old: str) -> bool:
    try:
        return int(new) > int(old)
    except ValueError:  # resourceVersions are opaque in general; then any difference is news
        return new != old
