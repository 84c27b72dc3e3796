"""The client side of the status endpoint: ``GET /status`` over the agent's unix socket.

Every failure becomes a StatusUnavailableError whose message says what to do; the CLI
prints it as it is.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

from agent.errors import PlatformError

DEFAULT_TIMEOUT_S = 5.0


class StatusUnavailableError(PlatformError):
    """The agent's status could not be read (no agent, refused, bad answer)."""


class NoStatusSocketError(StatusUnavailableError):
    """Nothing at the socket path: no agent runs here, or it uses another path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"no status socket at {path}")


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix stream socket; the Host header says ``localhost``."""

    def __init__(self, path: Path, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = Path(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.unix_path))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def fetch_status(path: Path, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The status document from the agent listening on ``path``."""
    status, body = _get(Path(path), "/status", timeout)
    if status != 200:
        raise StatusUnavailableError(f"the agent at {path} answered HTTP {status}: {_error_text(body)}")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StatusUnavailableError(f"the agent at {path} answered with invalid JSON: {err}") from err
    if not isinstance(doc, dict):
        raise StatusUnavailableError(
            f"the agent at {path} answered with JSON {type(doc).__name__}, not a status object"
        )
    return doc


def _get(path: Path, route: str, timeout: float) -> tuple[int, bytes]:
    conn = UnixHTTPConnection(path, timeout)
    try:
        conn.request("GET", route, headers={"Accept": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except FileNotFoundError as err:
        raise NoStatusSocketError(path) from err
    except TimeoutError as err:
        raise StatusUnavailableError(f"the agent at {path} did not answer within {timeout:g} s") from err
    except http.client.HTTPException as err:
        raise StatusUnavailableError(
            f"the agent at {path} answered with something that is not HTTP ({type(err).__name__}: {err})"
        ) from err
    except OSError as err:
        raise StatusUnavailableError(_connect_problem(path, err)) from err
    finally:
        conn.close()


def _connect_problem(path: Path, err: OSError) -> str:
    if err.errno == errno.ECONNREFUSED and not _is_socket(path):
        return f"{path} is not a socket, so no agent serves status there (check --socket)"
    if err.errno == errno.ECONNREFUSED:
        return (
            f"nothing answers on {path}: the agent that made it is gone "
            "(the next `vcuda-agent run` replaces the stale socket), or it is not a status socket"
        )
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {path}: the status names pods, so it is for root only (try sudo)"
    if err.errno == errno.ENOTDIR:
        return f"no status socket at {path}: a part of the path is not a directory"
    return f"cannot reach the agent at {path}: {err.strerror or err}"


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return True  # cannot tell: keep the general message


def _error_text(body: bytes) -> str:
    """The ``error`` of a JSON error body, else the body's first line."""
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        return str(parsed["error"])
    text = body.decode(errors="replace").strip().splitlines()
    return text[0][:200] if text else "(empty body)"
