"""The status endpoint: HTTP over a unix socket, read by ``vcuda-agent status``.

Routes: ``GET /status`` → 200, ``application/json``, the snapshot (schema in
``surfaces/statusview.py``); ``GET /healthz`` → 200 ``ok``; any other path → 404 and
any other method → 405, both with a JSON body ``{"error": "..."}``. When the snapshot
function raises, the answer is 500 with the error in the body; the server keeps
serving. Responses are HTTP/1.0 (one request per connection), which every HTTP/1.1
client accepts::

    curl --unix-socket /run/vcuda-agent/status.sock http://localhost/status

The socket is mode 0660 (root): the status names the node's pods. It is chmodded
between bind() and listen(), so nobody can connect while its mode is still the umask's.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from agent.errors import PlatformError
from agent.platform.httpserving import QuietServing

log = logging.getLogger(__name__)

Snapshot = Callable[[], Mapping[str, Any]]
SOCKET_MODE = 0o660
DIR_MODE = 0o755
_PROBE_TIMEOUT_S = 1.0
_REQUEST_TIMEOUT_S = 5.0  # a client that stalls mid-request does not hold a thread for longer


class StatusSocketInUseError(PlatformError):
    """Another live process answers on the status socket (a second agent on this node)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"another agent serves status on {path}")


class StatusServer:
    """Serves ``snapshot()`` as ``GET /status`` on ``socket_path`` from thread ``status-endpoint``."""

    def __init__(self, socket_path: Path, snapshot: Snapshot) -> None:
        self.socket_path = Path(socket_path)
        self._snapshot = snapshot
        self._httpd: _UnixHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    def start(self) -> None:
        """Bind (replacing a stale socket file), then serve on a daemon thread.

        Raises StatusSocketInUseError when another process answers on the path, and
        PlatformError when the socket cannot be made (path too long, permissions).
        """
        if self._thread is not None:
            raise PlatformError(f"status endpoint on {self.socket_path} is already started")
        self._make_parent()
        httpd = _UnixHTTPServer(self.socket_path, self._handler_class())
        bound = False
        try:
            self._bind(httpd)
            bound = True
            # Before listen(): until then nobody can connect, whatever the umask made the mode.
            os.chmod(self.socket_path, SOCKET_MODE)
            st = os.stat(self.socket_path)
            httpd.server_activate()
        except OSError as err:
            self._abandon(httpd, bound)
            raise PlatformError(f"cannot set up the status socket {self.socket_path}: {err}") from err
        except BaseException:
            self._abandon(httpd, bound)
            raise
        self._httpd = httpd
        self._inode = (st.st_dev, st.st_ino)
        self._thread = threading.Thread(target=httpd.serve_forever, name="status-endpoint", daemon=True)
        self._thread.start()
        log.info("status on unix socket %s (vcuda-agent status)", self.socket_path)

    def stop(self) -> None:
        """Stop serving and remove the socket file (only if it is still ours). Idempotent."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is None or thread is None:
            return
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        self._remove_own_socket()

    # -- socket file lifecycle -------------------------------------------------------------

    def _make_parent(self) -> None:
        parent = self.socket_path.parent
        if parent.is_dir():
            return  # someone else's directory (the state dir): its mode is theirs to choose
        try:
            parent.mkdir(parents=True, exist_ok=True)
            os.chmod(parent, DIR_MODE)  # mkdir's mode is masked by the umask
        except OSError as err:
            raise PlatformError(f"cannot create {parent} for the status socket: {err.strerror}") from err

    def _bind(self, httpd: _UnixHTTPServer) -> None:
        """bind() fails with EADDRINUSE while any file is at the path: that makes the check
        for a live agent and the claim of the path one step, except for the stale case."""
        for attempt in range(2):
            try:
                httpd.socket.bind(str(self.socket_path))
            except OSError as err:
                if err.errno == errno.EADDRINUSE and attempt == 0:
                    self._clear_stale()
                    continue
                raise PlatformError(
                    f"cannot bind the status socket {self.socket_path}: {err.strerror or err}"
                ) from err
            break

    def _abandon(self, httpd: _UnixHTTPServer, bound: bool) -> None:
        """A start that failed half-way leaves no socket file behind."""
        httpd.server_close()
        if bound:
            self.socket_path.unlink(missing_ok=True)

    def _clear_stale(self) -> None:
        path = self.socket_path
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return  # gone meanwhile
        except OSError as err:
            raise PlatformError(f"cannot inspect {path}: {err.strerror}") from err
        if not stat.S_ISSOCK(mode):
            raise PlatformError(f"{path} exists and is not a socket; remove it or choose another path")
        if _answers(path):
            raise StatusSocketInUseError(path)
        log.info("removing stale status socket %s (nothing answers on it)", path)
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            raise PlatformError(f"cannot remove the stale status socket {path}: {err.strerror}") from err

    def _remove_own_socket(self) -> None:
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._inode:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass  # already removed: the goal is reached
        except OSError as err:
            log.warning("could not remove the status socket %s: %s", self.socket_path, err.strerror)

    # -- HTTP --------------------------------------------------------------------------------

    def _status_body(self) -> tuple[int, bytes]:
        try:
            body = json.dumps(_finite(dict(self._snapshot())), allow_nan=False).encode()
        except Exception as err:  # a bug in a snapshot costs one answer, not the endpoint
            log.exception("status snapshot failed")
            return 500, _json_error(f"status snapshot failed: {type(err).__name__}: {err}")
        return 200, body

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = _REQUEST_TIMEOUT_S
            server_version = "vcuda-agent-status"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/status":
                    code, body = server._status_body()
                    self._send(code, body, "application/json")
                elif path == "/healthz":
                    self._send(200, b"ok", "text/plain; charset=utf-8")
                else:
                    self._send(404, _json_error(f"not found: {path}; try /status or /healthz"))

            def _not_allowed(self) -> None:
                self._send(405, _json_error(f"method {self.command} not allowed; use GET"), allow=True)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _not_allowed

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                # Malformed requests (400, 414, 505...): JSON like every other answer, with a
                # status line even when the request line was too broken to name a version
                # (the library would answer HTTP/0.9 style, body only).
                self.close_connection = True
                if self.request_version == "HTTP/0.9":
                    self.request_version = "HTTP/1.0"
                self._send(code, _json_error(message or self.responses.get(code, ("error",))[0]))

            def _send(
                self, code: int, body: bytes, content_type: str = "application/json", allow: bool = False
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if allow:
                    self.send_header("Allow", "GET")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def address_string(self) -> str:
                return "unix"  # unix-socket peers have no address; the default indexes one

            def log_message(self, format: str, *args: object) -> None:
                log.debug("status http: " + format, *args)

        return Handler


class _UnixHTTPServer(QuietServing, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64  # unix connect() fails with EAGAIN, not waits, when the backlog is full

    def __init__(self, path: Path, handler: type[BaseHTTPRequestHandler]) -> None:
        # Bound by StatusServer._bind: the stale-socket check sits between bind attempts.
        super().__init__(str(path), handler, bind_and_activate=False)


def _answers(path: Path) -> bool:
    """Does something accept connections on the unix socket ``path``?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except (TimeoutError, BlockingIOError):
        return True  # a full backlog: a live but busy server
    except OSError as err:
        raise PlatformError(f"cannot probe the status socket {path}: {err.strerror or err}") from err
    finally:
        probe.close()
    return True


def _finite(value: Any) -> Any:
    """NaN and infinities become null: JSON has no spelling for them, and one bad number
    should not make the whole status unreadable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
