"""A list+watch loop over one kind of object (client-go's Reflector, pared down).

LIST (a consistent read of the current state), then WATCH from the list's
resourceVersion with bookmarks, tracking the resourceVersion of every event and
BOOKMARK. A watch that ends (server timeout) or whose connection drops is resumed from
the last resourceVersion, so no event is missed and nothing is re-listed. A 410 Gone
(an HTTP status or an ERROR event) means the server no longer has the history after our
resourceVersion: the loop re-lists, and delivers the differences between what it had
and the new list as synthetic ADDED / MODIFIED / DELETED events, so a consumer never
misses a deletion that happened while the watch was down. Other errors back off (0.5 s
doubling to 30 s, reset by the next success) on the injected clock. A run of failures (an
API server outage) is logged as one WARNING, a reminder every ``_REMIND_S``, and one INFO
when the server answers again; the tries in between are DEBUG.

Objects are the API's JSON as dicts (``_preload_content=False``): the client's model
deserializer is far too slow for a thousand pods.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3

from agent.clock import Clock, SystemClock
from agent.errors import KubeError
from agent.platform.kube.client import call, json_call
from agent.stopsignal import on_stop

log = logging.getLogger(__name__)

# The client's list method, e.g. CoreV1Api.list_pod_for_all_namespaces or CoreV1Api.list_node.
ListFunction = Callable[..., Any]
# handler(event_type, object): "ADDED" | "MODIFIED" | "DELETED", in resourceVersion order.
EventHandler = Callable[[str, dict[str, Any]], None]
_CONNECT_TIMEOUT_S = 10.0
_QUICK_END_S = 1.0  # a watch that ends sooner than this is followed by a back-off
_REMIND_S = 300.0  # while the API keeps failing, a WARNING this often (the rest is DEBUG)


@dataclass
class ReflectorStats:
    lists: int = 0
    watches: int = 0  # watch requests that got a stream
    relists_410: int = 0
    watch_restarts: int = 0  # streams that ended or broke and were resumed from the last rv
    errors: int = 0
    events: int = 0
    bookmarks: int = 0
    synced: bool = False  # a list has completed
    last_sync: float | None = None  # clock.monotonic() of the last list, event or bookmark
    resource_version: str = ""
    last_error: str = ""


class Reflector:
    """Keeps ``handler`` in step with the objects ``list_fn`` lists (see the module docstring)."""

    def __init__(
        self,
        list_fn: ListFunction,
        handler: EventHandler,
        what: str,
        *,
        field_selector: str = "",
        clock: Clock | None = None,
        on_synced: Callable[[], None] | None = None,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        watch_timeout_s: float = 300.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.what = what
        self._list_fn = list_fn
        self._handler = handler
        self._selector = field_selector or None
        self._clock = clock or SystemClock()
        self._on_synced = on_synced
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {}  # key (uid) → last object seen
        self._stats = ReflectorStats()
        self._response: Any = None  # the open watch stream, so stop can interrupt its read
        # The current run of failed requests (the loop's thread only): count, start, last WARNING.
        self._failures, self._failing_since, self._warned_at = 0, 0.0, 0.0

    @property
    def stats(self) -> ReflectorStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def objects(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def run(self, stop: threading.Event) -> None:
        """List, then watch until ``stop`` is set. Starts with a list, also after a restart."""
        done = threading.Event()
        cancel = on_stop(stop, self._interrupt)
        if cancel is None:  # a plain Event: a thread looks at it
            threading.Thread(
                target=self._stop_reads, args=(stop, done), name=f"{self.what}-stop", daemon=True
            ).start()
        try:
            self._loop(stop)
        finally:
            done.set()
            if cancel is not None:
                cancel()

    def _loop(self, stop: threading.Event) -> None:
        backoff, relist = self._min_backoff_s, True
        while not stop.is_set():
            started = self._clock.monotonic()
            try:
                if relist:
                    self._list()
                    relist = False
                self._watch(stop)
                self._count(watch_restarts=1)
            except KubeError as err:
                if stop.is_set():
                    return
                if err.status != 410:
                    self._count(errors=1, last_error=str(err))
                    self._failed(err, backoff)
                    if self._clock.sleep(backoff, stop):
                        return
                    backoff = min(self._max_backoff_s, backoff * 2)
                    continue
                self._count(relists_410=1)
                log.info("%s; listing %s again", err, self.what)
                relist = True
            # A stream that ends at once, or a 410 right after a list, must not become a hot loop.
            if self._clock.monotonic() - started < _QUICK_END_S:
                if self._clock.sleep(backoff, stop):
                    return
                backoff = min(self._max_backoff_s, backoff * 2)
            else:
                backoff = self._min_backoff_s

    def _list(self) -> None:
        # No resourceVersion: a consistent read of the current state, never an old cached one.
        body = json_call(
            f"list {self.what}",
            lambda: self._list_fn(
                field_selector=self._selector,
                _preload_content=False,
                _request_timeout=(_CONNECT_TIMEOUT_S, self._request_timeout_s),
            ),
        )
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise KubeError(f"list {self.what}: the API server sent no list metadata")
        items = [o for o in body.get("items") or [] if isinstance(o, dict)]
        fresh = {_key(o): o for o in items}
        with self._lock:
            old = self._objects
            self._objects = fresh
        for key, obj in fresh.items():
            before = old.get(key)
            if before is None:
                self._handler("ADDED", obj)
            elif _rv(before) != _rv(obj):
                self._handler("MODIFIED", obj)
        for key, obj in old.items():
            if key not in fresh:
                self._handler("DELETED", obj)  # vanished while we were not watching
        self._answered()
        self._count(lists=1, synced=True, resource_version=str(body["metadata"].get("resourceVersion") or ""))
        if self._on_synced is not None:
            self._on_synced()

    def _watch(self, stop: threading.Event) -> None:
        """One watch stream, until the server ends it or its connection breaks."""
        timeout_s = int(self._watch_timeout_s * random.uniform(1.0, 2.0))  # spread re-watches out
        response = call(
            f"watch {self.what}",
            lambda: self._list_fn(
                field_selector=self._selector,
                watch=True,
                resource_version=self.stats.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, timeout_s),
                _preload_content=False,
                _request_timeout=(_CONNECT_TIMEOUT_S, timeout_s + 60.0),
            ),
        )
        self._answered()
        self._count(watches=1)
        with self._lock:
            self._response = response
        try:
            if stop.is_set():
                return
            for line in _lines(response):
                self._on_line(line)
        except (urllib3.exceptions.HTTPError, OSError) as err:
            if not stop.is_set():
                log.info(
                    "%s: the watch broke (%s); resuming from %s", self.what, err, self.stats.resource_version
                )
        finally:
            with self._lock:
                self._response = None
            response.close()  # a stream left half-read must not go back to the pool as it is
            response.release_conn()

    def _on_line(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError, RecursionError) as err:  # Recursion: nested too deep
            raise KubeError(f"watch {self.what}: a line that is not a watch event: {line[:200]!r}") from err
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            message = obj.get("message") if isinstance(obj, dict) else obj
            raise KubeError(f"watch {self.what}: {message}", status=code if isinstance(code, int) else None)
        rv = _rv(obj)
        if kind == "BOOKMARK":
            self._count(bookmarks=1, resource_version=rv)
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring a watch event of type %r", self.what, kind)
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata", {}), dict):
            raise KubeError(f"watch {self.what}: a {kind} event whose object or metadata is not an object")
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(_key(obj), None)
            else:
                self._objects[_key(obj)] = obj
        self._handler(kind, obj)
        self._count(events=1, resource_version=rv or self.stats.resource_version)

    def _failed(self, err: KubeError, backoff: float) -> None:
        now = self._clock.monotonic()
        self._failures += 1
        if self._failures == 1:
            self._failing_since = self._warned_at = now
            log.warning(
                "%s; retrying with back-off up to %.0f s (further failures are logged at DEBUG until it "
                "works again)",
                err,
                self._max_backoff_s,
            )
        elif now - self._warned_at >= _REMIND_S:
            self._warned_at = now
            log.warning(
                "%s: still failing after %d tries over %.0f s: %s",
                self.what,
                self._failures,
                now - self._failing_since,
                err,
            )
        else:
            log.debug("%s; retrying in %.1f s", err, backoff)

    def _answered(self) -> None:
        if self._failures:
            log.info(
                "%s: the API server answers again after %d failed tries over %.0f s",
                self.what,
                self._failures,
                self._clock.monotonic() - self._failing_since,
            )
            self._failures = 0

    def _count(self, **changes: Any) -> None:
        with self._lock:
            for name, value in changes.items():
                counter = isinstance(value, int) and not isinstance(value, bool)
                setattr(self._stats, name, getattr(self._stats, name) + value if counter else value)
            if {"lists", "events", "bookmarks"} & changes.keys():
                self._stats.last_sync = self._clock.monotonic()

    def _stop_reads(self, stop: threading.Event, done: threading.Event) -> None:
        while not stop.wait(0.25):
            if done.is_set():
                return
        self._interrupt()

    def _interrupt(self) -> None:
        """A watch read blocks for minutes: once stopping, shut its socket to end it now."""
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.shutdown()
            except (ValueError, RuntimeError, OSError) as err:
                log.debug("%s: could not interrupt the watch read: %s", self.what, err)


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    return str(meta.get("uid") or f"{meta.get('namespace') or ''}/{meta.get('name') or ''}")


def _rv(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
