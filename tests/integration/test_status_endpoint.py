"""The status endpoint over a real unix socket with real HTTP, and `vcuda-agent status`
against it: JSON round trip, the table, errors (500, 404, missing socket, refused,
permission denied, bad JSON), stale and live sockets, HTTP/1.0 clients."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.errors import PlatformError
from agent.surfaces.cli import status
from agent.surfaces.statusserver import StatusServer, StatusSocketInUseError

REPO = Path(__file__).resolve().parents[2]
# The example of the schema docstring, two GPUs: shared, burstable (no memory quota), whole.
SAMPLE: dict[str, Any] = json.loads((Path(__file__).parent / "status_sample.json").read_text())


@pytest.fixture
def sock(short_dir: Path) -> Path:
    return short_dir / "run" / "status.sock"


@pytest.fixture
def serve(sock: Path) -> Iterator[Callable[..., StatusServer]]:
    started: list[StatusServer] = []

    def start(snapshot: Callable[[], Mapping[str, Any]] = lambda: SAMPLE, path: Path = sock) -> StatusServer:
        server = StatusServer(path, snapshot)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def raw_request(path: Path, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """What `curl --unix-socket` does, by hand: one request, read until the server closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def get(path: Path, route: str) -> tuple[int, dict[str, str], bytes]:
    return raw_request(path, f"GET {route} HTTP/1.0\r\n\r\n".encode())


def cli(sock: Path, as_json: bool = False) -> int:
    return status.main(argparse.Namespace(socket=str(sock), json=as_json, watch=None))


def test_json_output_is_the_snapshot_exactly(
    serve: Callable[..., StatusServer], sock: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    serve()
    assert cli(sock, as_json=True) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == SAMPLE
    assert err == ""


def test_table_names_each_container_with_policy_cap_and_duty(
    serve: Callable[..., StatusServer],
    sock: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    serve()
    assert cli(sock) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("node n1  backend simulated  enforcement on  actuator freezer  memory kill")
    row = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and "/" in line}
    infer = ["fixed-share", "30", "30%", "30%", "29.5%", "0.31", "1.00", "no"]
    assert row["default/infer-7/server"][1:9] == infer
    assert row["batch/etl/worker"][1:9] == ["burstable", "50", "50%", "75%", "71.2%", "0.77", "-", "yes"]
    assert row["batch/etl/worker"][9] == "300/-"
    trainer = ["fixed-share", "100", "-", "-", "97%", "-", "-", "no", "40000/81559"]
    assert row["ml/trainer-0/main"][1:10] == trainer
    assert "killed pid 123" in out


def test_snapshot_error_is_a_500_and_the_server_keeps_serving(
    serve: Callable[..., StatusServer],
    sock: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[int] = []

    def flaky() -> Mapping[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("ledger is being rebuilt")
        return SAMPLE

    serve(flaky)
    code, headers, body = get(sock, "/status")
    assert code == 500
    assert headers["content-type"] == "application/json"
    assert "ledger is being rebuilt" in json.loads(body)["error"]
    code, _, body = get(sock, "/status")
    assert code == 200
    assert json.loads(body) == SAMPLE
    assert any(t.name == "status-endpoint" and t.is_alive() for t in threading.enumerate())

    calls.clear()  # the CLI sees the 500 as an error message, not a traceback
    assert cli(sock) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "HTTP 500" in err
    assert "ledger is being rebuilt" in err
    assert "Traceback" not in err


def test_raw_http10_request_gets_json(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve()
    code, headers, body = get(sock, "/status")
    assert code == 200
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body) == SAMPLE


def test_http11_request_with_host_header(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve()
    code, _, body = raw_request(
        sock, b"GET /status?x=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    assert code == 200
    assert json.loads(body)["node"] == "n1"


def test_healthz_404_and_405(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve()
    assert get(sock, "/healthz")[0::2] == (200, b"ok")
    code, headers, body = get(sock, "/metrics")
    assert code == 404
    assert headers["content-type"] == "application/json"
    assert "/metrics" in json.loads(body)["error"]
    code, _, body = raw_request(sock, b"POST /status HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    assert code == 405
    assert "POST" in json.loads(body)["error"]
    code, _, body = raw_request(sock, b"BREW /status HTTP/1.0\r\n\r\n")
    assert code == 501
    assert "BREW" in json.loads(body)["error"]
    code, _, body = raw_request(sock, b"GET /status HTTP/x.y\r\n\r\n")
    assert code == 400
    assert "version" in json.loads(body)["error"]


def test_socket_and_parent_modes_and_stop_removes_the_socket(
    serve: Callable[..., StatusServer], sock: Path
) -> None:
    server = serve()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o755
    server.stop()
    assert not os.path.lexists(sock)
    assert not any(t.name == "status-endpoint" for t in threading.enumerate())
    server.stop()  # idempotent


def test_stale_socket_file_is_replaced(serve: Callable[..., StatusServer], sock: Path) -> None:
    sock.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))  # a socket file that nothing listens on: a dead agent's leftover
    dead.close()
    os.chmod(sock, 0o600)
    serve()
    assert get(sock, "/status")[0] == 200
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o660  # a new socket, not the leftover


def test_second_server_on_a_live_socket_raises(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve()
    second = StatusServer(sock, lambda: {"version": 1, "node": "other"})
    with pytest.raises(StatusSocketInUseError, match=f"another agent serves status on {sock}"):
        second.start()
    assert isinstance(StatusSocketInUseError(sock), PlatformError)
    second.stop()  # never started: a no-op that must not remove the first one's socket
    code, _, body = get(sock, "/status")
    assert code == 200
    assert json.loads(body)["node"] == "n1"


def test_a_file_that_is_not_a_socket_is_left_alone(sock: Path) -> None:
    sock.parent.mkdir(parents=True)
    sock.write_text("precious")
    with pytest.raises(PlatformError, match="is not a socket"):
        StatusServer(sock, lambda: SAMPLE).start()
    assert sock.read_text() == "precious"


def test_non_finite_numbers_become_null(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve(lambda: {"version": 1, "gpus": [{"utilizationPercent": float("nan"), "x": [float("inf")]}]})
    code, _, body = get(sock, "/status")
    assert code == 200
    assert json.loads(body) == {"version": 1, "gpus": [{"utilizationPercent": None, "x": [None]}]}


def test_concurrent_clients(serve: Callable[..., StatusServer], sock: Path) -> None:
    serve()
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: get(sock, "/status")[0], range(64)))
    assert codes == [200] * 64


def test_cli_without_a_socket_says_no_agent_runs(sock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(sock) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        f"vcuda-agent status: no agent is running here (no status socket at {sock}); "
        "start it with `vcuda-agent run` or pass --socket"
    )


def test_cli_connection_refused(sock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))
    dead.close()
    assert cli(sock) == 1
    err = capsys.readouterr().err
    assert f"nothing answers on {sock}" in err
    assert "Traceback" not in err
    sock.unlink()
    sock.write_text("not a socket")
    assert cli(sock) == 1
    assert f"{sock} is not a socket" in capsys.readouterr().err


def test_cli_bad_json(sock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock.parent.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen()

    def answer_garbage() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{not json")

    thread = threading.Thread(target=answer_garbage)
    thread.start()
    try:
        assert cli(sock) == 1
    finally:
        thread.join(5)
        listener.close()
    err = capsys.readouterr().err
    assert "answered with invalid JSON" in err
    assert "Traceback" not in err


@pytest.mark.privileged
@pytest.mark.skipif(os.geteuid() != 0, reason="running the CLI as nobody needs root")
def test_cli_permission_denied_for_non_root(serve: Callable[..., StatusServer], sock: Path) -> None:
    """The 0660 socket refuses an unprivileged user (nobody), with a message, not a traceback."""
    serve()
    os.chmod(sock.parent.parent, 0o755)  # short_dir is 0700: let nobody reach the socket itself
    # The child imports as root (the checkout may sit in a directory only root can read,
    # like a fresh `mktemp -d` clone), then becomes nobody before it connects.
    code = (
        "import argparse, os, sys; from agent.surfaces.cli import status; "
        "os.setgroups([]); os.setgid(65534); os.setuid(65534); "
        f"sys.exit(status.main(argparse.Namespace(socket={str(sock)!r}, json=False, watch=None)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert f"permission denied on {sock}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_watch_redraws_and_survives_the_agent_leaving(
    serve: Callable[..., StatusServer],
    sock: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = serve()
    assert status.watch(sock, 0.1, as_json=False, rounds=2) == 0
    out = capsys.readouterr().out
    assert out.count("Every 0.1s: vcuda-agent status") == 2
    assert out.count("GPU 1  NVIDIA H100") == 2
    server.stop()
    assert status.watch(sock, 0.1, as_json=True, rounds=1) == 1
    assert "no agent is running here" in capsys.readouterr().out


def test_parser_options_and_defaults() -> None:
    parser = argparse.ArgumentParser(prog="vcuda-agent")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    status.add_parser(sub, common)
    args = parser.parse_args(["status"])
    assert (args.socket, args.json, args.watch) == ("/run/vcuda-agent/status.sock", False, None)
    assert args.func is status.main
    args = parser.parse_args(["status", "--socket", "/tmp/s.sock", "--json", "--watch", "2.5"])
    assert (args.socket, args.json, args.watch) == ("/tmp/s.sock", True, 2.5)
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["status", "--watch", bad])


def test_a_path_too_long_for_a_unix_socket_is_a_platform_error(short_dir: Path) -> None:
    path = short_dir / ("d" * 60) / ("s" * 60)
    with pytest.raises(PlatformError, match="status socket"):
        StatusServer(path, lambda: SAMPLE).start()
    assert not any(t.name == "status-endpoint" for t in threading.enumerate())
