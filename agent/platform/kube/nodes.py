"""This node's Node object: patches of its status (extended resources) and metadata, and a
watch of it (so a publisher can react at once when kubelet zeroes what it advertised)."""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api

from agent.clock import Clock
from agent.errors import KubeError
from agent.platform.kube.client import json_call
from agent.platform.kube.reflector import Reflector, ReflectorStats
from agent.stopsignal import notifier, on_stop

_JSON_PATCH = "application/json-patch+json"
_MERGE_PATCH = "application/merge-patch+json"
_ABORT_POLL_S = 0.1  # a plain abort Event is looked at this often (a StopSignal wakes the wait)


def pointer_escape(key: str) -> str:
    """A map key as one JSON-pointer segment: "~" → "~0", "/" → "~1" (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def offered_resources(node: Mapping[str, Any] | None) -> dict[str, str] | None:
    """A Node's status.capacity with status.allocatable over it: what it offers to pods
    (resource → quantity text); None for no node."""
    if node is None:
        return None
    status = node.get("status") or {}
    merged = {**(status.get("capacity") or {}), **(status.get("allocatable") or {})}
    return {str(k): str(v) for k, v in merged.items()}


class NodeClient:
    """Reads and patches one node (``node_name``)."""

    def __init__(self, api: ApiClient, node_name: str, request_timeout_s: float = 10.0) -> None:
        self.node_name = node_name
        self._core = CoreV1Api(api)
        self._timeout = request_timeout_s

    def get(self) -> dict[str, Any]:
        """The Node as JSON; KubeError(status=404) when it does not exist."""
        body: dict[str, Any] = json_call(
            f"read node {self.node_name}",
            lambda: self._core.read_node(
                self.node_name, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return body

    def uid(self) -> str:
        """metadata.uid of the Node; KubeError when it cannot be read or has none."""
        uid = (self.get().get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            raise KubeError(f"node {self.node_name} has no metadata.uid")
        return uid

    def patch_extended_resources(self, resources: Mapping[str, str]) -> None:
        """Set each resource in status.capacity and status.allocatable (PATCH nodes/<n>/status).

        A JSON patch ``add`` sets a key whether or not it exists, and touches nothing else; a
        node whose status has no capacity/allocatable map yet gets a merge patch instead."""
        if not resources:
            return
        ops = [
            {"op": "add", "path": f"/status/{field}/{pointer_escape(name)}", "value": str(value)}
            for field in ("capacity", "allocatable")
            for name, value in resources.items()
        ]
        what = f"patch extended resources {sorted(resources)} of node {self.node_name}"
        try:
            self._patch_status(what, ops, _JSON_PATCH)
        except KubeError as err:
            if err.status not in (400, 422):  # 422: a parent map is missing
                raise
            values = {k: str(v) for k, v in resources.items()}
            self._patch_status(what, {"status": {"capacity": values, "allocatable": values}}, _MERGE_PATCH)

    def patch_metadata(self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> None:
        """Merge-patch labels and annotations (None deletes a key); status is not touched."""
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        if not meta:
            return
        json_call(
            f"patch labels/annotations of node {self.node_name}",
            lambda: self._core.patch_node(
                self.node_name,
                {"metadata": meta},
                _content_type=_MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
        )

    def _patch_status(self, what: str, body: Any, content_type: str) -> None:
        json_call(
            what,
            lambda: self._core.patch_node_status(
                self.node_name,
                body,
                _content_type=content_type,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
        )


class NodeWatch:
    """A list+watch of this one node (``fieldSelector=metadata.name=<n>``); a counter that
    goes up on every change lets a loop sleep until the node changes."""

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
        self._changed = threading.Condition()
        self._node: dict[str, Any] | None = None
        self._version = 0
        self._reflector = Reflector(
            CoreV1Api(api).list_node,
            self._on_event,
            what=f"node {node_name}",
            field_selector=f"metadata.name={node_name}",
            clock=clock,
            on_synced=self._on_synced,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            watch_timeout_s=watch_timeout_s,
        )

    def run(self, stop: threading.Event) -> None:
        self._reflector.run(stop)

    def current(self) -> dict[str, Any] | None:
        """The node as last seen (a copy), or None before the first list or after deletion."""
        with self._changed:
            return copy.deepcopy(self._node)

    @property
    def version(self) -> int:
        with self._changed:
            return self._version

    @property
    def stats(self) -> ReflectorStats:
        return self._reflector.stats

    def wait_for_change(
        self, seen_version: int, timeout_s: float, abort: threading.Event | None = None
    ) -> int:
        """Block (real time) until the counter differs from ``seen_version``, ``timeout_s``
        passes or ``abort`` is set; return the counter."""
        deadline = time.monotonic() + timeout_s
        cancel = None if abort is None else on_stop(abort, notifier(self._changed))
        slice_s = _ABORT_POLL_S if abort is not None and cancel is None else math.inf  # a plain Event: polled
        try:
            with self._changed:
                while self._version == seen_version and not (abort is not None and abort.is_set()):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._changed.wait(min(remaining, slice_s))
                return self._version
        finally:
            if cancel is not None:
                cancel()

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self._changed:
            self._node = None if kind == "DELETED" else obj
            self._version += 1
            self._changed.notify_all()

    def _on_synced(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()
