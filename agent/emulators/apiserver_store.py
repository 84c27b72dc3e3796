"""The object store behind the fake API server: objects per resource, one global
resourceVersion bumped on every write, a bounded history of changes, and the open
watches with their queues.

Stored objects are never mutated in place (every write stores a new dict), so readers
may serialize a reference outside the lock.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.emulators.apiserver_objects import default_metadata, default_pod
from agent.emulators.apiserver_patch import PatchError
from agent.emulators.apiserver_query import ApiStatusError, Selector, conflict, expired, not_found


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    namespaced: bool
    has_status: bool  # writes to the object ignore status; the status subresource changes only status
    group: str = ""  # "" is the core group, served under /api/v1
    version: str = "v1"
    status_on_create: bool = True  # False: a create drops status (its strategy's PrepareForCreate)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


_DRA = "resource.k8s.io"
_RBAC = "rbac.authorization.k8s.io"
# Keyed by plural, which is unique across the groups served here.
RESOURCES = {
    "pods": Resource("pods", "Pod", namespaced=True, has_status=True),
    "nodes": Resource("nodes", "Node", namespaced=False, has_status=True),
    "events": Resource("events", "Event", namespaced=True, has_status=False),
    # Dynamic Resource Allocation (GA in 1.34): what drivers publish and users claim.
    "resourceslices": Resource("resourceslices", "ResourceSlice", False, False, _DRA),
    "deviceclasses": Resource("deviceclasses", "DeviceClass", False, False, _DRA),
    "resourceclaims": Resource("resourceclaims", "ResourceClaim", True, True, _DRA, status_on_create=False),
    "resourceclaimtemplates": Resource("resourceclaimtemplates", "ResourceClaimTemplate", True, False, _DRA),
    # Cluster-wide RBAC, what apiserver_auth.py's SubjectAccessReview decides from.
    "clusterroles": Resource("clusterroles", "ClusterRole", False, False, _RBAC),
    "clusterrolebindings": Resource("clusterrolebindings", "ClusterRoleBinding", False, False, _RBAC),
}
_IMMUTABLE_META = ("name", "namespace", "uid", "creationTimestamp")


@dataclass
class Change:
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)
class Watcher:
    resource: str
    namespace: str | None
    selector: Selector
    queue: deque[tuple[str, dict[str, Any]]] = field(default_factory=deque)
    expired: bool = False  # history compacted under it: its next event is a 410 ERROR
    finished: bool = False  # an ERROR was queued; the stream ends after it
    dropped: bool = False  # drop_watches(): the connection is cut without a proper end

    def sees(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return self.selector.matches(obj)


class Store:
    """Thread-safe objects, resourceVersion, history and watches."""

    def __init__(self, history_limit: int = 1000) -> None:
        self._cond = threading.Condition()
        self._rv = 1
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in RESOURCES}
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._floor = 0  # changes up to this rv are gone from the history
        self._watchers: set[Watcher] = set()
        self._closed = False

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        with self._cond:
            obj = self._objects[resource].get((namespace, name))
        if obj is None:
            raise not_found(resource, name)
        return obj

    def list_items(
        self,
        resource: str,
        namespace: str | None,
        selector: Selector,
        rv_text: str | None = None,
        match: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Items (sorted by namespace/name) and the list's resourceVersion.

        ``match`` "Exact" serves the state at ``rv_text`` from the history (410 when compacted);
        otherwise the current state is served (it is never older than any given rv)."""
        with self._cond:
            rv, objects = self._rv, self._objects[resource]
            if match == "Exact":
                rv = _parse_rv(rv_text)
                if rv < self._floor:
                    raise ApiStatusError(
                        410, "Expired", f"The resourceVersion for the provided list is too old: {rv}"
                    )
                objects = self._state_at(resource, rv)
            items = [o for key, o in sorted(objects.items()) if namespace in (None, key[0])]
        return [o for o in items if selector.matches(o)], str(rv)

    def _state_at(self, resource: str, rv: int) -> dict[tuple[str, str], dict[str, Any]]:
        state = dict(self._objects[resource])
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.resource != resource:
                continue
            key = _key(change.new)
            if change.old is None:
                state.pop(key, None)
            else:
                state[key] = change.old
        return state

    def create(self, resource: str, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        namespaced = RESOURCES[resource].namespaced
        new = default_metadata(copy.deepcopy(obj), namespace if namespaced else None)
        if not namespaced:
            new["metadata"].pop("namespace", None)
        name = new["metadata"].get("name")
        if not name:
            raise ApiStatusError(422, "Invalid", f"{resource}: metadata.name or generateName is required")
        new["kind"], new["apiVersion"] = RESOURCES[resource].kind, RESOURCES[resource].api_version
        if resource == "pods":
            default_pod(new)
        if not RESOURCES[resource].status_on_create:
            new.pop("status", None)
        with self._cond:
            key = _key(new)
            if key in self._objects[resource]:
                raise ApiStatusError(
                    409, "AlreadyExists", f'{resource} "{name}" already exists', name, resource
                )
            return self._commit(resource, "ADDED", None, new)

    def update(
        self,
        resource: str,
        namespace: str,
        name: str,
        change: Callable[[dict[str, Any]], Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Apply ``change`` to a copy of the object (a patch or a replacement).

        A resourceVersion in the result that differs from the stored one is a failed
        precondition (409). A result equal to the stored object is a no-op: no new rv, no event."""
        with self._cond:
            current = self._objects[resource].get((namespace, name))
            if current is None:
                raise not_found(resource, name)
            try:
                new = change(copy.deepcopy(current))
            except PatchError as err:
                raise ApiStatusError(
                    err.code, "Invalid" if err.code == 422 else "BadRequest", str(err)
                ) from err
            if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
                raise ApiStatusError(422, "Invalid", f'{resource} "{name}": the result is not an object')
            meta, old_meta = new.setdefault("metadata", {}), current["metadata"]
            if meta.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
                raise conflict(resource, name)
            if RESOURCES[resource].has_status:
                if subresource == "status":
                    new = {**current, "status": new.get("status") or {}}
                elif "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
            new["metadata"] = {
                **new.get("metadata", {}),
                **{k: old_meta[k] for k in _IMMUTABLE_META if k in old_meta},
            }
            new["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
            new["kind"], new["apiVersion"] = RESOURCES[resource].kind, RESOURCES[resource].api_version
            if new == current:
                return current
            return self._commit(resource, "MODIFIED", current, new)

    def delete(
        self, resource: str, namespace: str, name: str, uid: str | None = None, rv: str | None = None
    ) -> dict[str, Any]:
        with self._cond:
            current = self._objects[resource].get((namespace, name))
            if current is None:
                raise not_found(resource, name)
            meta = current["metadata"]
            if (uid and uid != meta.get("uid")) or (rv and rv != meta.get("resourceVersion")):
                raise conflict(resource, name)
            gone = self._commit(resource, "DELETED", current, copy.deepcopy(current))
            self._collect_garbage(str(meta.get("uid") or ""))
            return gone

    def _collect_garbage(self, owner_uid: str) -> None:
        """The garbage collector (background propagation), done at once: an object with an
        ownerReference to the deleted object's uid, and none to an object still stored, is
        deleted too, and so on down. (The real one also deletes dependents of owners that
        never existed, and waits for finalizers; neither is modelled.)"""
        # Caller holds the lock.
        pending = [owner_uid] if owner_uid else []
        while pending:
            uid = pending.pop()
            dependents = [
                (resource, obj, owners)
                for resource, objects in self._objects.items()
                for obj in objects.values()
                if uid in (owners := _owner_uids(obj))
            ]
            if not dependents:
                continue
            alive = {o["metadata"].get("uid") for objects in self._objects.values() for o in objects.values()}
            for resource, obj, owners in dependents:
                if not owners & alive:
                    self._commit(resource, "DELETED", obj, copy.deepcopy(obj))
                    if obj["metadata"].get("uid"):
                        pending.append(str(obj["metadata"]["uid"]))

    def _commit(
        self, resource: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any]
    ) -> dict[str, Any]:
        # Caller holds the lock.
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._objects[resource][_key(new)]
        else:
            self._objects[resource][_key(new)] = new
        change = Change(self._rv, resource, kind, old, new)
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self._floor = self._history.popleft().rv
        for watcher in self._watchers:
            if watcher.resource == resource:
                self._deliver(watcher, change)
        self._cond.notify_all()
        return new

    def _deliver(self, watcher: Watcher, change: Change) -> None:
        if watcher.finished or watcher.dropped:
            return
        if watcher.expired:
            watcher.queue.append(("ERROR", expired(self._rv - 1, self._floor + 1).status()))
            watcher.finished = True
            return
        was, now = watcher.sees(change.old), change.type != "DELETED" and watcher.sees(change.new)
        if change.type == "DELETED":
            kind = "DELETED" if was else ""
        elif was and now:
            kind = "MODIFIED"
        else:  # an object that moved into or out of the selector is added or deleted for this watch
            kind = "ADDED" if now else ("DELETED" if was else "")
        if kind:
            watcher.queue.append((kind, change.new))

    def watch(self, resource: str, namespace: str | None, selector: Selector, rv_text: str | None) -> Watcher:
        """Open a watch: from rv "0" or none, synthetic ADDED for the current state; from an rv,
        every retained change after it; from an rv older than the history, a 410 ERROR."""
        watcher = Watcher(resource, namespace, selector)
        with self._cond:
            if rv_text in (None, "", "0"):
                for _, obj in sorted(self._objects[resource].items()):
                    if watcher.sees(obj):
                        watcher.queue.append(("ADDED", obj))
            else:
                rv = _parse_rv(rv_text)
                if rv < self._floor:
                    watcher.queue.append(("ERROR", expired(rv, self._floor + 1).status()))
                    watcher.finished = True
                    return watcher
                for change in self._history:
                    if change.rv > rv and change.resource == resource:
                        self._deliver(watcher, change)
            self._watchers.add(watcher)
        return watcher

    def next_events(self, watcher: Watcher, timeout_s: float) -> tuple[list[tuple[str, dict[str, Any]]], str]:
        """Wait up to ``timeout_s`` for events; also returns the state: open|finished|dropped|closed."""
        with self._cond:
            if not watcher.queue and not (watcher.finished or watcher.dropped or self._closed):
                self._cond.wait(max(0.0, timeout_s))
            events = list(watcher.queue)
            watcher.queue.clear()
            if watcher.dropped:
                state = "dropped"
            elif watcher.finished:
                state = "finished"
            else:
                state = "closed" if self._closed else "open"
        return events, state

    def bookmark_rv(self, watcher: Watcher) -> str | None:
        """The rv a BOOKMARK may carry now: the current one, if the watcher has nothing queued."""
        with self._cond:
            return None if watcher.queue or watcher.finished else str(self._rv)

    def unwatch(self, watcher: Watcher) -> None:
        with self._cond:
            self._watchers.discard(watcher)

    def open_watches(self, resource: str | None = None) -> int:
        with self._cond:
            return sum(1 for w in self._watchers if resource in (None, w.resource))

    def compact(self) -> None:
        """Drop the whole history: older rvs get 410, and every open watch gets a 410 ERROR
        instead of its next event (as when etcd compacts the revision a watch is on)."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv
            for watcher in self._watchers:
                watcher.expired = True

    def drop_watches(self) -> None:
        with self._cond:
            for watcher in self._watchers:
                watcher.dropped = True
            self._cond.notify_all()

    def close(self) -> None:
        """End every open watch (the server is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        with self._cond:
            self._closed = False

    def all(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        items, _ = self.list_items(resource, namespace, Selector())
        return items


def _owner_uids(obj: dict[str, Any]) -> set[str]:
    refs = obj["metadata"].get("ownerReferences")
    return (
        {str(r.get("uid")) for r in refs if isinstance(r, dict) and r.get("uid")}
        if isinstance(refs, list)
        else set()
    )


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return str(meta.get("namespace") or ""), str(meta["name"])


def _parse_rv(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError:
        raise ApiStatusError(400, "BadRequest", f"invalid resourceVersion {text!r}") from None
