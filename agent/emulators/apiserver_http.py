"""The HTTP side of the fake API server: routing, Status errors, chunked watch streams.

See agent/emulators/apiserver.py for what the server models and what it does not.
"""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from agent.emulators.apiserver_auth import AuthReviews
from agent.emulators.apiserver_patch import json_patch, merge_patch
from agent.emulators.apiserver_query import ApiStatusError, Selector, status_object
from agent.emulators.apiserver_store import RESOURCES, Store

log = logging.getLogger(__name__)

# /api/v1/... for the core group, /apis/<group>/<version>/... for the others.
_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z0-9.-]+)/(?P<version>v[0-9a-z]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?/?$"
)
_MERGE_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
_JSON_PATCH = "application/json-patch+json"
_PEER_CHECK_S = 1.0  # how often an idle watch checks that its client is still there
# Create-only reviews (apiserver_auth.py): answered, never stored.
_REVIEWS = {
    ("authentication.k8s.io", "tokenreviews"): "token",
    ("authorization.k8s.io", "subjectaccessreviews"): "access",
}
_REASONS = {400: "BadRequest", 404: "NotFound", 409: "Conflict", 410: "Expired", 429: "TooManyRequests"}


@dataclass
class RequestRecord:
    """One request the server received (``status`` is filled in when it is answered)."""

    method: str
    path: str
    query: dict[str, str]
    status: int = 0

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


class ApiBackend(Protocol):
    """What the handler needs from the server object."""

    store: Store
    auth: AuthReviews
    bookmark_interval_s: float
    max_watch_s: float

    def connection_opened(self, sock: socket.socket) -> None: ...

    def connection_closed(self, sock: socket.socket) -> None: ...

    def record_request(
        self, method: str, path: str, query: dict[str, str]
    ) -> tuple[RequestRecord, int | None]:
        """Log the request; return its record and the HTTP status to fail it with, if any."""
        ...


class ApiHandler(BaseHTTPRequestHandler):
    """One connection to the fake API server (``server.api`` is the ApiBackend)."""

    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle the body waits for the client's delayed ACK
    # (40 ms on Linux) on every keep-alive request; kube-apiserver sets TCP_NODELAY too.
    disable_nagle_algorithm = True
    api: ApiBackend
    _record: RequestRecord

    def setup(self) -> None:
        super().setup()
        self.api = self.server.api  # type: ignore[attr-defined]
        self.api.connection_opened(self.connection)

    def finish(self) -> None:
        self.api.connection_closed(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fake apiserver: " + format, *args)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        record, failure = self.api.record_request(method, url.path, query)
        self._record = record
        try:
            if failure is not None:
                reason = _REASONS.get(failure, "InternalError")
                raise ApiStatusError(failure, reason, f"injected failure {failure} for {method} {url.path}")
            body = json.loads(raw) if raw else None
            self._route(method, url.path, query, body)
        except ApiStatusError as err:
            self._send(err.code, err.status())
        except ValueError as err:  # a body that is not JSON, a malformed query parameter
            self._send(400, status_object(400, "BadRequest", f"bad request: {err}"))

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> int:
        if path in ("/version", "/healthz", "/readyz"):
            # 1.36: the release whose resource.k8s.io/v1 (consumable capacity on) this models.
            return self._send(200, {"major": "1", "minor": "36", "gitVersion": "v1.36.0-fake"})
        match = _PATH.match(path)
        review = _REVIEWS.get((match["group"], match["res"])) if match else None
        if review is not None and match and match["ns"] is None and match["name"] is None:
            if method != "POST" or match["version"] != "v1":
                raise ApiStatusError(405, "MethodNotAllowed", f"{method} is not supported on {path}")
            auth = self.api.auth
            return self._send(201, auth.token_review(body) if review == "token" else auth.access_review(body))
        if not match or match["res"] not in (*RESOURCES, "bindings"):
            raise ApiStatusError(404, "NotFound", f"the server could not find the requested resource {path}")
        group, version = match["group"] or "", match["version"] or "v1"
        ns, res, name, sub = match["ns"], match["res"], match["name"], match["sub"]
        if res == "bindings" and not group and method == "POST" and ns and not name:
            return self._bind(ns, str((body or {}).get("metadata", {}).get("name") or ""), body)
        resource = RESOURCES.get(res)
        if (
            resource is None
            or (resource.group, resource.version) != (group, version)
            or (ns is not None and not resource.namespaced)
        ):
            raise ApiStatusError(404, "NotFound", f"the server could not find the requested resource {path}")
        store = self.api.store
        if name is None:
            if method == "GET":
                return self._list_or_watch(res, ns, query)
            if method == "POST" and (ns is not None or not resource.namespaced):
                return self._send(201, store.create(res, ns, _object(body)))
            raise ApiStatusError(405, "MethodNotAllowed", f"{method} is not supported on {path}")
        key_ns = ns or ""
        if sub == "binding" and res == "pods" and method == "POST":
            return self._bind(key_ns, name, body)
        if sub not in (None, "status") or (sub == "status" and not resource.has_status):
            raise ApiStatusError(404, "NotFound", f"the server could not find the requested resource {path}")
        if method == "GET":
            return self._send(200, store.get(res, key_ns, name))
        if method == "PATCH":
            patch = _patcher(self.headers.get("Content-Type") or "", body)
            return self._send(200, store.update(res, key_ns, name, patch, sub))
        if method == "PUT":
            replacement = _object(body)
            return self._send(200, store.update(res, key_ns, name, lambda _cur: replacement, sub))
        if method == "DELETE" and sub is None:
            pre = (body or {}).get("preconditions") or {}
            return self._send(
                200, store.delete(res, key_ns, name, pre.get("uid"), pre.get("resourceVersion"))
            )
        raise ApiStatusError(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    def _bind(self, namespace: str, name: str, body: Any) -> int:
        binding = _object(body)
        target = str((binding.get("target") or {}).get("name") or "")
        uid = (binding.get("metadata") or {}).get("uid")
        if not name or not target:
            raise ApiStatusError(400, "BadRequest", "a Binding needs metadata.name and target.name")

        def change(pod: dict[str, Any]) -> dict[str, Any]:
            if uid and uid != pod["metadata"]["uid"]:
                raise ApiStatusError(
                    409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                    f"UID in object meta: {pod['metadata']['uid']}", name, "pods"
                )  # fmt: skip
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                raise ApiStatusError(
                    409, "Conflict", f"pod {name} is already assigned to node {bound!r}", name, "pods"
                )
            return {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": target}}

        self.api.store.update("pods", namespace, name, change)
        return self._send(201, status_object(201, "", "", name, "pods") | {"status": "Success"})

    def _list_or_watch(self, res: str, ns: str | None, query: dict[str, str]) -> int:
        selector = Selector(query.get("fieldSelector", ""), query.get("labelSelector", ""))
        rv = query.get("resourceVersion")
        if query.get("watch") in ("true", "1"):
            return self._watch(res, ns, selector, rv, query)
        items, list_rv = self.api.store.list_items(res, ns, selector, rv, query.get("resourceVersionMatch"))
        resource = RESOURCES[res]
        return self._send(
            200,
            {
                "kind": f"{resource.kind}List",
                "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": list_rv},
                "items": items,
            },
        )

    def _watch(
        self, res: str, ns: str | None, selector: Selector, rv: str | None, query: dict[str, str]
    ) -> int:
        store, kind, api_version = self.api.store, RESOURCES[res].kind, RESOURCES[res].api_version
        timeout = min(float(query.get("timeoutSeconds") or self.api.max_watch_s), self.api.max_watch_s)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        interval = self.api.bookmark_interval_s
        watcher = store.watch(res, ns, selector, rv)
        self.send_response(200)
        self._record.status = 200
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        now = time.monotonic()
        deadline, next_bookmark = now + timeout, now + interval
        try:
            while not self._peer_closed():  # at least one pass: what is queued goes out even at timeout 0
                until = min(deadline, next_bookmark if bookmarks else deadline, now + _PEER_CHECK_S)
                events, state = store.next_events(watcher, until - now)
                for event_type, obj in events:
                    self._chunk({"type": event_type, "object": obj})
                if state == "dropped":
                    self.connection.shutdown(socket.SHUT_RDWR)  # abrupt: no terminating chunk
                    return 200
                if state != "open":
                    break
                if bookmarks and time.monotonic() >= next_bookmark:
                    bookmark_rv = store.bookmark_rv(watcher)
                    if bookmark_rv is not None:
                        meta = {"resourceVersion": bookmark_rv}
                        self._chunk(
                            {
                                "type": "BOOKMARK",
                                "object": {"kind": kind, "apiVersion": api_version, "metadata": meta},
                            }
                        )
                    next_bookmark = time.monotonic() + interval
                if (now := time.monotonic()) >= deadline:
                    break
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            log.debug("watch client went away")  # the client closed its end
        finally:
            store.unwatch(watcher)
        return 200

    def _peer_closed(self) -> bool:
        # A watch client sends nothing; readable means it closed its end (recv returns b"").
        readable, _, _ = select.select([self.connection], [], [], 0)
        return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)

    def _chunk(self, obj: Any) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send(self, code: int, obj: Any) -> int:
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(code)
        self._record.status = code
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return code


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiStatusError(400, "BadRequest", "the request body must be a JSON object")
    return body


def _patcher(content_type: str, body: Any) -> Any:
    media = content_type.split(";", maxsplit=1)[0].strip()
    if media in _MERGE_TYPES:
        patch = _object(body)
        return lambda cur: merge_patch(cur, patch)
    if media == _JSON_PATCH:
        return lambda cur: json_patch(cur, body)
    raise ApiStatusError(415, "UnsupportedMediaType", f"the patch type {media!r} is not supported")
