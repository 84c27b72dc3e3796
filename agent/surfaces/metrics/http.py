"""HTTP endpoint: /metrics (Prometheus text format), /healthz, /readyz.

With an ``authorize`` decision (``--metrics-auth kubernetes``: control/metricsauth.py),
/metrics answers only a request whose ``Authorization: Bearer`` token the API server
authenticates for a user allowed to ``get`` /metrics: 401, 403, or 503 while the API server
cannot say. /healthz and /readyz stay open: kubelet's probes carry no token, and they tell
nothing about the node's pods. With a TLS context the port serves HTTPS only (the probes
then use ``scheme: HTTPS``); the handshake runs in the connection's thread, under its timeout.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.control.metricsauth import Decision
from agent.errors import ConfigError, PlatformError
from agent.platform.httpserving import QuietServing
from agent.surfaces.metrics.exposition import CONTENT_TYPE, render

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]
Authorize = Callable[[str | None], Decision]  # the Authorization header -> the decision
_TIMEOUT_S = 30.0  # a connection's handshake, request and each write: a stalled client lets go


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server context for --metrics-tls-cert/--metrics-tls-key (ConfigError naming them)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as err:
        why = getattr(err, "strerror", None) or err
        raise ConfigError([f"--metrics-tls-cert/--metrics-tls-key: cannot use {cert}, {key}: {why}"]) from err
    return context


class _Server(QuietServing, ThreadingHTTPServer):
    """Sleeps until a scrape comes (agent/platform/httpserving.py)."""


class MetricsServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        readiness: Readiness,
        *,
        authorize: Authorize | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._registry = registry
        self._readiness = readiness
        self._authorize = authorize
        self._tls = tls
        handler = self._handler_class()
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as err:
            raise PlatformError(
                f"cannot serve metrics on {host}:{port}: {err.strerror or err} (see --metrics-address)"
            ) from err
        self._httpd.daemon_threads = True
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        scheme = "https" if self._tls is not None else "http"
        auth = "" if self._authorize is None else " (bearer token, checked with the Kubernetes API)"
        log.info("metrics on %s://%s:%d/metrics%s", scheme, *self.address, auth)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = _TIMEOUT_S

            def handle(self) -> None:
                if isinstance(self.connection, ssl.SSLSocket):
                    try:
                        self.connection.do_handshake()
                    except (ssl.SSLError, OSError) as err:
                        log.debug("metrics: TLS handshake with %s failed: %s", self.client_address[0], err)
                        return
                super().handle()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    decision = self._decide()
                    if decision is None or decision.allowed:
                        self._send(200, render(server._registry), CONTENT_TYPE)
                    else:
                        self._send(decision.code, (decision.reason + "\n").encode())
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ready, reason = server._readiness()
                    self._send(200 if ready else 503, (reason + "\n").encode())
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _decide(self) -> Decision | None:
                if server._authorize is None:
                    return None
                return server._authorize(self.headers.get("Authorization"))

            def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                if code == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="vcuda-agent metrics"')
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

        return Handler
