"""HTTP endpoint: /metrics (Prometheus text format), /healthz, /readyz."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry

from agent.errors import PlatformError
from agent.surfaces.metrics.exposition import CONTENT_TYPE, render

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, readiness: Readiness) -> None:
        self._registry = registry
        self._readiness = readiness
        handler = self._handler_class()
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as err:
            raise PlatformError(
                f"cannot serve metrics on {host}:{port}: {err.strerror or err} (see --metrics-address)"
            ) from err
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, render(server._registry), CONTENT_TYPE)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ready, reason = server._readiness()
                    self._send(200 if ready else 503, (reason + "\n").encode())
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

        return Handler
