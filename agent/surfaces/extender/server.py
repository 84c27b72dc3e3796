"""The extender's HTTP server: POST /filter, /prioritize, /bind; GET /healthz, /readyz, /metrics.

kube-scheduler POSTs to ``<urlPrefix>/<verb>``; any path ending in ``/filter``,
``/prioritize`` or ``/bind`` is routed to that verb, so a urlPrefix with a path works too.
A body that is not the protocol gets HTTP 400 with ``{"error": "<what is wrong>"}`` (the field
kube-scheduler logs); an unexpected failure in a handler gets 500 the same way and is logged:
the server keeps serving either way. /readyz is 503 until the Node and Pod caches have
completed their first LIST (before that, filter would promise capacity that is taken).

Hostile or careless clients: over HTTPS the verbs need a verified client certificate (403
without one; transport.py). A request must send its headers and body within
``read_timeout_s`` (408 and the connection closed otherwise), a keep-alive connection idles
at most ``idle_timeout_s``, bodies are capped at MAX_BODY (413, unread) and bodies over
1 MiB are read one at a time, and at most ``max_connections`` are served at once (more are
closed at accept): a slow or huge client costs one connection, never the server.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from agent.errors import PlatformError
from agent.platform.httpserving import QuietServing
from agent.surfaces.extender.service import ExtenderService
from agent.surfaces.extender.wire import WireError

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20  # a NodeList of 5000 nodes with their status (nodeCacheCapable: false) is ~30 MiB
_LARGE_BODY = 1 << 20  # bodies above this are read one at a time (memory stays bounded)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_VERBS_NEED_CERT = "the extender's verbs need a client certificate signed by its --client-ca"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold (ExtenderSettings documents each)."""

    read_timeout_s: float = 10.0
    idle_timeout_s: float = 120.0
    max_connections: int = 64


class _Server(QuietServing, ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # kube-scheduler binds in parallel; the default backlog of 5 resets them

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limit: int) -> None:
        super().__init__(address, handler)
        self._limit = limit
        self._active = 0
        self._count_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= self._limit
            if not full:
                self._active += 1
        if full:
            log.warning("extender: %d connections open, closing one from %s", self._limit, client_address[0])
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    @property
    def active(self) -> int:
        with self._count_lock:
            return self._active

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes or times out mid-request is routine, not a traceback.
        log.info("extender: connection from %s ended with an error", client_address[0], exc_info=True)


class ExtenderMetrics:
    """Request counts and latency per verb, in an explicit registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "vcuda_extender_requests",
            "Extender requests by verb and HTTP status code",
            ["verb", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "vcuda_extender_request_seconds",
            "Time to answer an extender request, by verb",
            ["verb"],
            buckets=_BUCKETS,
            registry=self.registry,
        )


class ExtenderServer:
    """ThreadingHTTPServer around an ExtenderService."""

    def __init__(
        self,
        host: str,
        port: int,
        service: ExtenderService,
        metrics: ExtenderMetrics | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.service = service
        self.metrics = metrics or ExtenderMetrics()
        self.limits = limits or ServerLimits()
        self._tls = tls
        self._large_body = threading.Lock()
        self._verbs: dict[str, Callable[[bytes], Any]] = {
            "filter": service.filter,
            "prioritize": service.prioritize,
            "bind": service.bind,
        }
        try:
            self._httpd = _Server((host, port), self._handler_class(), self.limits.max_connections)
        except OSError as err:
            raise PlatformError(f"cannot serve the extender on {host}:{port}: {err.strerror or err}") from err
        if tls is not None:
            # The handshake runs in the connection's thread (handle()), under its read timeout:
            # a client that stalls it holds one connection, not the accept loop.
            self._httpd.socket = tls.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def open_connections(self) -> int:
        """Connections being served now (at most ``limits.max_connections``)."""
        return self._httpd.active

    @property
    def url(self) -> str:
        return "{}://{}:{}".format("https" if self._tls else "http", *self.address)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="extender-http", daemon=True)
        self._thread.start()
        log.info("scheduler extender on %s", self.url)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ExtenderServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, verb: str, body: bytes) -> tuple[int, Any]:
        """(HTTP status, JSON answer) for one POST; never raises."""
        started = time.perf_counter()
        try:
            code, answer = 200, self._verbs[verb](body)
        except WireError as err:
            code, answer = 400, {"error": str(err)}
        except Exception as err:  # a bug must cost one answer, not the server
            log.exception("the %s handler failed", verb)
            code, answer = (
                500,
                {"error": f"internal error in the vcuda extender: {type(err).__name__}: {err}"},
            )
        self.metrics.latency.labels(verb).observe(time.perf_counter() - started)
        self.metrics.requests.labels(verb, str(code)).inc()
        return code, answer

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: kube-scheduler reuses its connections
            # Headers and body are two writes: with Nagle, the body waits for the client's
            # delayed ACK (40 ms on Linux) on every keep-alive request.
            disable_nagle_algorithm = True
            timeout = server.limits.read_timeout_s  # the TLS handshake; then per phase below

            def handle(self) -> None:
                if isinstance(self.connection, ssl.SSLSocket):
                    try:
                        self.connection.do_handshake()
                    except (ssl.SSLError, OSError) as err:
                        log.info("extender: TLS handshake with %s failed: %s", self.client_address[0], err)
                        return
                super().handle()

            def handle_one_request(self) -> None:
                self.connection.settimeout(server.limits.idle_timeout_s)
                super().handle_one_request()

            def parse_request(self) -> bool:
                # The request line has arrived: headers and body must follow promptly.
                self.connection.settimeout(server.limits.read_timeout_s)
                return super().parse_request()

            def do_POST(self) -> None:
                verb = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
                length_text = self.headers.get("Content-Length")
                if length_text is None or not length_text.isdigit():
                    self._refuse(411, "a POST needs a Content-Length")
                    return
                if int(length_text) > MAX_BODY:
                    self._refuse(413, f"a body of {length_text} bytes is over the limit of {MAX_BODY}")
                    return
                if server._tls is not None and not self.connection.getpeercert():
                    self._refuse(403, _VERBS_NEED_CERT)
                    return
                body = self._read_body(int(length_text))
                if body is None:
                    self._refuse(408, f"the body did not arrive within {server.limits.read_timeout_s:g} s")
                    return
                if verb not in server._verbs:
                    self._json(404, {"error": f"no verb {verb!r}: POST /filter, /prioritize or /bind"})
                    return
                self._json(*server.handle(verb, body))

            def _read_body(self, length: int) -> bytes | None:
                """The body, or None when it is not complete by the deadline (one deadline for
                the whole body: a client trickling a byte per second does not reset it)."""
                if length <= _LARGE_BODY:
                    return self._read_until(length, time.monotonic() + server.limits.read_timeout_s)
                with server._large_body:
                    return self._read_until(length, time.monotonic() + server.limits.read_timeout_s)

            def _read_until(self, length: int, deadline: float) -> bytes | None:
                chunks: list[bytes] = []
                left = length
                try:
                    while left:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return None
                        self.connection.settimeout(remaining)
                        chunk = self.rfile.read1(min(left, _LARGE_BODY))
                        if not chunk:
                            return None
                        chunks.append(chunk)
                        left -= len(chunk)
                except TimeoutError:
                    return None
                return b"".join(chunks)

            def _refuse(self, code: int, message: str) -> None:
                self.close_connection = True  # the rest of the body is unread: the stream is lost
                try:
                    self._json(code, {"error": message})
                except OSError as err:
                    log.info("extender: could not answer %s %d: %s", self.client_address[0], code, err)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ready = server.service.view.ready
                    self._send(
                        200 if ready else 503, b"ok\n" if ready else b"node and pod caches not synced\n"
                    )
                elif path == "/metrics":
                    self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(
                        404,
                        b"not found: GET /healthz, /readyz or /metrics; POST /filter, /prioritize, /bind\n",
                    )

            def _json(self, code: int, answer: Any) -> None:
                self._send(code, json.dumps(answer, separators=(",", ":")).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("extender http: " + format, *args)

        return Handler
