"""A fake kube-apiserver for tests and the demo, driven by the real ``kubernetes`` client.

It speaks real Kubernetes JSON over plain HTTP (``ThreadingHTTPServer``) for core/v1
pods (namespaced, with the ``status`` and ``binding`` subresources), nodes (with
``status``) and events, and for the Dynamic Resource Allocation kinds of
``resource.k8s.io/v1`` at their real paths (``/apis/resource.k8s.io/v1/...``):
ResourceSlices and DeviceClasses (cluster-scoped), ResourceClaims (namespaced, with
``status``; a create drops the status, as the real strategy does) and
ResourceClaimTemplates, and for ClusterRoles and ClusterRoleBindings
(``rbac.authorization.k8s.io/v1``): create, get, list, watch, patch (merge,
strategic-as-merge, JSON patch), replace, delete, bind. Every object gets its group's
``apiVersion`` and ``kind``, lists are ``<Kind>List``. One global resourceVersion is bumped on every write; a
``metadata.resourceVersion`` in a patch or replacement is a precondition (409). Writes to
an object ignore its status and writes to ``/status`` change only the status, as the real
server does. Field selectors (any dotted field, ``=``/``==``/``!=``) and equality label
selectors filter lists and watches; an object that moves in or out of a watch's selector
is delivered as ADDED or DELETED.

Watches stream ``{"type", "object"}`` lines (chunked): from rv "0" or none, synthetic
ADDED for the current state; from an rv, the retained history after it; from an rv older
than the history, an ERROR event with a 410 "Expired" Status. ``allowWatchBookmarks``
gets a BOOKMARK every ``bookmark_interval_s`` when the watch is idle; ``timeoutSeconds``
ends the stream cleanly. A LIST with ``resourceVersionMatch=Exact`` is served from the
history (410 when compacted); other LISTs serve the current state (which is never older
than any rv, so ``NotOlderThan`` does not 410, as on the real server). ``stop()`` then
``start()`` is an API server restart: same port, same objects and history.

Test and demo hooks (Python methods): ``create_pod``, ``create_node``, ``pod``, ``node``,
``create_object`` / ``get_object`` / ``objects`` / ``delete_object`` (any resource above),
``set_pod_phase``, ``patch_pod``, ``delete_pod``, ``compact`` (410 for every older rv and
for every open watch at its next event), ``drop_watches`` (cut every watch connection),
``fail_next`` (inject HTTP errors), ``refuse`` / ``allow`` (answer every request of one method on
one path with an error until allowed again), ``zero_extended_resources`` (what kubelet does to a
re-created node), ``events``, ``request_log``, ``write_kubeconfig``.

TokenReview and SubjectAccessReview (create only, apiserver_auth.py: a token table the test fills
with ``auth.add_token`` / ``auth.service_account_token``, RBAC from the stored ClusterRoles and
ClusterRoleBindings). Every request is served whatever credentials it carries.

Not modelled: TLS, authentication and authorization of the requests themselves, admission
(quota, limit ranges, webhooks), validation beyond names (a PUT without resourceVersion is unconditional; the
real server wants one), defaulting other than kind/apiVersion, uid, creationTimestamp,
resourceVersion, namespace, generateName, pod status.phase Pending and status.qosClass;
the real server's short list of selectable fields per resource (any field works here);
namespaces as objects; protobuf and CBOR; server-side apply; strategic-merge list keys and
``$patch`` directives; pagination (``limit`` is ignored, every list is complete); set-based
label selectors; graceful deletion and finalizers (DELETE removes at once, and with it, as the
garbage collector would, the objects whose ownerReferences name only deleted objects); ``watch``
``sendInitialEvents``; slow-watcher eviction; other API groups and resources; discovery
(``/api``, ``/apis``: clients must use the paths, as the agent's do). For the DRA kinds: no
validation at all (field formats, DNS names, the immutability of ``spec.pool.name`` or of an
allocation once set, the 128-device limit: a test that needs an object to be valid checks it
against the OpenAPI schema itself), no ``DRA*`` feature gates (every field is kept), no
allocation (agent/emulators/draallocator.py plays the scheduler), no resourceclaim controller
(agent/emulators/draclaims.py makes claims from templates), no
``resource.kubernetes.io/delete-protection`` finalizer.
"""

from __future__ import annotations

import copy
import logging
import socket
import sys
import threading
from collections import deque
from collections.abc import Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from agent.emulators.apiserver_auth import AuthReviews
from agent.emulators.apiserver_http import ApiHandler, RequestRecord
from agent.emulators.apiserver_objects import node_manifest, pod_status, zero_extended_resources
from agent.emulators.apiserver_patch import merge_patch
from agent.emulators.apiserver_query import ApiStatusError
from agent.emulators.apiserver_store import Store

__all__ = ["FakeApiServer", "RequestRecord"]
log = logging.getLogger(__name__)


class _QuietServer(ThreadingHTTPServer):
    """A client that goes away mid-request (an agent killed with SIGKILL) is normal here."""

    def handle_error(self, request: object, client_address: object) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            log.debug("client %s went away: %s", client_address, err)
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class FakeApiServer:
    """A kube-apiserver stand-in on ``http://127.0.0.1:<port>`` (see the module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bookmark_interval_s: float = 1.0,
        history_limit: int = 1000,
        max_watch_s: float = 1800.0,
        request_log_limit: int = 10_000,
    ) -> None:
        self.store = Store(history_limit)
        self.auth = AuthReviews(self.store)  # tokens for TokenReview, RBAC for SubjectAccessReview
        self.bookmark_interval_s = bookmark_interval_s
        self.max_watch_s = max_watch_s
        self._address = (host, port)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._log: deque[RequestRecord] = deque(maxlen=request_log_limit)  # bounded for long demos
        self._failures: list[int] = []
        self._refusals: dict[tuple[str, str], int] = {}  # (method, path) -> HTTP status
        self._connections: set[socket.socket] = set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Serve; after a ``stop()`` this is an API server restart: same port, same objects."""
        self.store.reopen()
        server = _QuietServer(self._address, ApiHandler)
        server.daemon_threads = True
        server.api = self  # type: ignore[attr-defined]
        host, port = server.server_address[:2]
        self._address = (str(host), int(port))  # a restart binds the same port
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Close the listening socket and every connection (open watches end)."""
        if self._server is None:
            return
        self.store.close()  # ends open watches cleanly
        self._server.shutdown()
        self._server.server_close()
        with self._lock:  # keep-alive connections would go on being served
            connections, self._connections = list(self._connections), set()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("connection already closed")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> FakeApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._address
        if not port:
            raise RuntimeError("the fake API server has not been started")
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (YAML) whose current context points at this server, without credentials."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # -- hooks for tests and the demo ------------------------------------------------------

    def create_pod(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        namespace = str((manifest.get("metadata") or {}).get("namespace") or "default")
        return copy.deepcopy(self.store.create("pods", namespace, dict(manifest)))

    def create_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        capacity: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        manifest = node_manifest(name, labels, capacity, allocatable, annotations)
        return copy.deepcopy(self.store.create("nodes", None, manifest))

    def create_object(
        self, resource: str, manifest: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Create any served resource (``resource`` is its plural, e.g. "deviceclasses")."""
        return copy.deepcopy(self.store.create(resource, namespace, dict(manifest)))

    def get_object(self, resource: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        return self._copy_or_none(resource, namespace, name)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.store.all(resource, namespace)))

    def delete_object(self, resource: str, name: str, namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(self.store.delete(resource, namespace, name))

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._copy_or_none("pods", namespace, name)

    def node(self, name: str) -> dict[str, Any] | None:
        return self._copy_or_none("nodes", "", name)

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.store.all("pods", namespace)))

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.store.all("events", namespace)))

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch a pod's metadata/spec (not its status)."""
        return copy.deepcopy(self.store.update("pods", namespace, name, lambda cur: merge_patch(cur, patch)))

    def set_pod_phase(
        self, namespace: str, name: str, phase: str, container_ids: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """What kubelet reports: the phase and one status per container (with IDs when given)."""

        def change(pod: dict[str, Any]) -> dict[str, Any]:
            return {**pod, "status": pod_status(pod, phase, container_ids)}

        return copy.deepcopy(self.store.update("pods", namespace, name, change, "status"))

    def delete_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.store.delete("pods", namespace, name))

    def delete_node(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.store.delete("nodes", "", name))

    def zero_extended_resources(self, node: str) -> dict[str, Any]:
        """Set every extended resource of the node to "0", as kubelet does on a re-created node."""

        def change(obj: dict[str, Any]) -> dict[str, Any]:
            return {**obj, "status": zero_extended_resources(obj)}

        return copy.deepcopy(self.store.update("nodes", "", node, change, "status"))

    def compact(self) -> None:
        self.store.compact()

    def drop_watches(self) -> None:
        self.store.drop_watches()

    def open_watches(self, resource: str | None = None) -> int:
        return self.store.open_watches(resource)

    def fail_next(self, count: int, status: int = 500) -> None:
        """The next ``count`` requests (of any kind) are answered with ``status``."""
        with self._lock:
            self._failures.extend([status] * count)

    def refuse(self, method: str, path: str, status: int = 503) -> None:
        """Fault-injection knob: every ``method`` request on exactly ``path`` (e.g. PATCH
        ``/api/v1/namespaces/default/pods/p``) is answered with ``status`` until ``allow``."""
        with self._lock:
            self._refusals[(method.upper(), path)] = status

    def allow(self) -> None:
        """Undo every ``refuse``."""
        with self._lock:
            self._refusals.clear()

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    @property
    def request_log(self) -> list[RequestRecord]:
        """The most recent requests, oldest first (method, path, query, status)."""
        with self._lock:
            return list(self._log)

    def clear_request_log(self) -> None:
        with self._lock:
            self._log.clear()

    def connection_opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.add(sock)

    def connection_closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

    def _copy_or_none(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return copy.deepcopy(self.store.get(resource, namespace, name))
        except ApiStatusError:
            return None

    def record_request(
        self, method: str, path: str, query: dict[str, str]
    ) -> tuple[RequestRecord, int | None]:
        record = RequestRecord(method, path, query)
        with self._lock:
            self._log.append(record)
            if self._failures:
                return record, self._failures.pop(0)
            return record, self._refusals.get((method, path))
