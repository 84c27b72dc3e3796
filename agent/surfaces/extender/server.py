"""The extender's HTTP server: POST /filter, /prioritize, /bind; GET /healthz, /readyz, /metrics.

kube-scheduler POSTs to ``<urlPrefix>/<verb>``; any path ending in ``/filter``,
``/prioritize`` or ``/bind`` is routed to that verb, so a urlPrefix with a path works too.
A body that is not the protocol gets HTTP 400 with ``{"error": "<what is wrong>"}`` (the field
kube-scheduler logs); an unexpected failure in a handler gets 500 the same way and is logged:
the server keeps serving either way. /readyz is 503 until the Node and Pod caches have
completed their first LIST (before that, filter would promise capacity that is taken).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from agent.errors import PlatformError
from agent.surfaces.extender.service import ExtenderService
from agent.surfaces.extender.wire import WireError

log = logging.getLogger(__name__)

MAX_BODY = 256 << 20  # a NodeList of 5000 nodes with their status is tens of MiB
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # kube-scheduler binds in parallel; the default backlog of 5 resets them


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
        self, host: str, port: int, service: ExtenderService, metrics: ExtenderMetrics | None = None
    ) -> None:
        self.service = service
        self.metrics = metrics or ExtenderMetrics()
        self._verbs: dict[str, Callable[[bytes], Any]] = {
            "filter": service.filter,
            "prioritize": service.prioritize,
            "bind": service.bind,
        }
        try:
            self._httpd = _Server((host, port), self._handler_class())
        except OSError as err:
            raise PlatformError(f"cannot serve the extender on {host}:{port}: {err.strerror or err}") from err
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="extender-http", daemon=True
        )
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

            def do_POST(self) -> None:
                verb = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
                length_text = self.headers.get("Content-Length")
                if length_text is None or not length_text.isdigit() or int(length_text) > MAX_BODY:
                    self._json(400, {"error": f"a POST needs a Content-Length of at most {MAX_BODY} bytes"})
                    self.close_connection = True
                    return
                body = self.rfile.read(int(length_text))
                if verb not in server._verbs:
                    self._json(404, {"error": f"no verb {verb!r}: POST /filter, /prioritize or /bind"})
                    return
                self._json(*server.handle(verb, body))

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
