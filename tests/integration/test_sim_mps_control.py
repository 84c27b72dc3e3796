"""The simulator's MPS control daemon (``sim-mps-control -f``, a real process) against real
clients of the GPU server: the daemon's limits bind a client whatever its environment says,
anyone who reaches the control socket changes them (so a tenant who can reach it lifts its
own limit, as on a real node), a client of another user id waits for the running server's
clients, and ``quit`` takes the clients' contexts with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.platform.gpu.mpspartition import effective_share
from agent.platform.gpu.sim.client import Connection
from agent.platform.gpu.sim.mpsdaemon import send_commands
from tests.integration.test_gpu_server import (
    GpuServerProcess,
    running_gpu_server,
    sim_command,
    stop_process,
    wait_for,
)

SMS = 132  # an H100's
TENANT_UID = 1000
# What a uid-1000 process runs: the system's Python (this checkout and its venv may sit where
# uid 1000 cannot read: mktemp -d is 0700).
SYSTEM_PYTHON = str(Path(sys.base_exec_prefix) / "bin" / "python3")


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    pipe: Path
    logs: Path

    def commands(self, *lines: str) -> list[str]:
        return send_commands(self.pipe, list(lines))


@pytest.fixture
def gpu_server(short_dir: Path) -> Iterator[GpuServerProcess]:
    with running_gpu_server(short_dir) as server:
        yield server


@pytest.fixture
def daemon(gpu_server: GpuServerProcess, short_dir: Path) -> Iterator[Daemon]:
    uuid = gpu_server.root.read_node().gpus[0].uuid
    pipe, logs = short_dir / "pipe", short_dir / "log"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": uuid,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(logs),
    }
    proc = subprocess.Popen(
        sim_command("sim-mps-control", "-f", "--sim-state-dir", str(gpu_server.root.root)), env=env
    )
    try:
        wait_for((pipe / "control").exists, "the daemon's control socket")
        yield Daemon(proc, pipe, logs)
    finally:
        stop_process(proc)


def open_client(gpu_server: GpuServerProcess, pipe: Path, percent: float = 100.0) -> tuple[Connection, Any]:
    conn = Connection(gpu_server.root.socket)
    reply = conn.call({"op": "open", "gpu": 0, "share": percent, "mps_pipe": str(pipe)})
    return conn, reply


def test_the_daemons_limit_binds_a_client_whatever_its_environment_says(
    gpu_server: GpuServerProcess, daemon: Daemon
) -> None:
    assert daemon.commands(
        "set_default_active_thread_percentage 30", "set_default_device_pinned_mem_limit 0 2G"
    ) == [
        "",
        "",
    ]
    cheat, reply = open_client(
        gpu_server, daemon.pipe, percent=100.0
    )  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100
    assert reply["ok"] and reply["share"] == pytest.approx(effective_share(30, SMS))
    assert reply["memory_limit_mib"] == 2048
    modest, lower = open_client(gpu_server, daemon.pipe, percent=10.0)
    assert lower["share"] == pytest.approx(effective_share(10, SMS))  # its own variable lowers it
    cheat.close()
    modest.close()


def test_whoever_reaches_the_control_socket_lifts_the_limit_for_later_clients(
    gpu_server: GpuServerProcess, daemon: Daemon
) -> None:
    daemon.commands("set_default_active_thread_percentage 30")
    first, reply = open_client(gpu_server, daemon.pipe)
    assert reply["share"] == pytest.approx(effective_share(30, SMS))
    [server] = daemon.commands("get_server_list")
    assert daemon.commands(f"set_active_thread_percentage {server} 100") == [""]  # NVIDIA plugin #1494
    second, lifted = open_client(gpu_server, daemon.pipe)
    assert lifted["share"] == 1.0
    # Both contexts are this test process's: one client process.
    assert daemon.commands(f"get_client_list {server}") == [str(os.getpid())]
    first.close()
    second.close()


def test_a_client_of_another_uid_waits_until_the_running_servers_clients_are_done(
    gpu_server: GpuServerProcess, daemon: Daemon, short_dir: Path
) -> None:
    os.chmod(short_dir, 0o755)
    os.chmod(gpu_server.root.root, 0o755)
    os.chmod(gpu_server.root.socket, 0o777)
    holder, reply = open_client(gpu_server, daemon.pipe)
    assert reply["ok"]
    other = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", _OPEN_AS_OTHER_USER, str(gpu_server.root.socket), str(daemon.pipe)],
        stdout=subprocess.PIPE,
        user=TENANT_UID,
        cwd="/",
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1.0)  # its open is not answered while root's server has a client
        holder.close()
        out, _ = other.communicate(timeout=10)
        assert other.returncode == 0 and json.loads(out)["ok"] is True
    finally:
        stop_process(other)


def test_quit_ends_the_daemon_and_its_clients_contexts(gpu_server: GpuServerProcess, daemon: Daemon) -> None:
    client, reply = open_client(gpu_server, daemon.pipe)
    assert reply["ok"] and len(gpu_server.contexts(0)) == 1
    assert daemon.commands("quit") == [""]
    assert daemon.proc.wait(timeout=10) == 0
    wait_for(lambda: gpu_server.contexts(0) == [], "the clients' contexts gone with their daemon")
    client.close()


def test_the_command_client_reads_commands_from_stdin(gpu_server: GpuServerProcess, daemon: Daemon) -> None:
    def client(commands: bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            sim_command("sim-mps-control", "--sim-state-dir", str(gpu_server.root.root)),
            input=commands,
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe)},
            capture_output=True,
            timeout=30,
            check=False,
        )

    done = client(b"set_default_active_thread_percentage 45\nget_default_active_thread_percentage\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == ["45.0"]
    bad = client(b"set_default_active_thread_percentage 0\n")
    assert bad.returncode == 1 and b"not in (0, 100]" in bad.stdout


_OPEN_AS_OTHER_USER = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(json.dumps({"op": "open", "gpu": 0, "share": 100, "mps_pipe": sys.argv[2]}).encode() + b"\\n")
print(sock.makefile().readline().strip())
"""
