"""A stand-in for ``nvidia-cuda-mps-control -f`` on a simulated node (``vcuda-agent
sim-mps-control``).

It reads what the real control daemon reads: ``CUDA_VISIBLE_DEVICES`` (the GPU's UUID),
``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``; it makes the pipe directory,
listens on ``<pipe>/control``, writes ``nvidia-cuda-mps-control.pid`` there (following a
symlink, as a daemon that opens the path does) and ``control.log`` in the log directory,
and serves the GPU as its MPS server: it holds an ``mps_attach`` connection to the node's
GPU server, which from then on runs the GPU's contexts as MPS clients and refuses contexts
that do not come through this pipe directory (EXCLUSIVE_PROCESS).

Control commands (:mod:`.mpscontrol`: defaults, per-server limits, servers per user id,
``quit``) arrive on the control socket one per line from anyone who can connect to it, as
``nvidia-cuda-mps-control`` sends them; each line is answered with what the command prints
and an empty line. :func:`send_commands` is that command-line client (``sim-mps-control``
without ``-f``: commands on stdin). It runs until ``quit``, SIGTERM/SIGINT, or until the GPU
server goes away (exit 1).

With ``-p 3`` (protocol 3, an r615+ driver: ``sim-gpu --driver-mps-v3``) it speaks MPS v3's
namespace commands (:mod:`.mpsnamespaces`) and tells the GPU server whether each command's
sender (SO_PEERCRED) runs as the daemon's own uid; ``-p 3 -h`` lists the server and
namespace modules where the driver has them, the check NVIDIA documents.

Not modelled: the server as a process of its own (the daemon's pid stands for the
server's), /dev/shm, the real daemon's wire protocol (private; this one is lines of text).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from agent.errors import SimulationError
from agent.platform.gpu.sim.client import Connection
from agent.platform.gpu.sim.nodefile import SimNodeDir

log = logging.getLogger(__name__)

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
COMMAND_TIMEOUT_S = 2.0
MAX_COMMAND_BYTES = 65536  # read from one connection


class _Stop(Exception):
    pass


V3_HELP = """Usage: sim-mps-control -p 3 [-f] <module> <verb> [--key=value ...]
Modules:
  server      the MPS servers (list)
  namespace   create, delete, list, set, get, bind (a namespace bound to a cgroup)
(the stand-in's spelling of the MPS v3 interface; see agent/platform/gpu/sim/mpsnamespaces.py)"""


def protocol_of(flag: int | None, environ: Mapping[str, str]) -> int:
    """The protocol asked for: CUDA_MPS_PROTOCOL_VERSION wins over ``-p``, as documented."""
    said = environ.get("CUDA_MPS_PROTOCOL_VERSION", "").strip()
    if said:
        if said not in ("2", "3"):
            raise SimulationError(f"CUDA_MPS_PROTOCOL_VERSION={said!r}: expected 2 or 3")
        return int(said)
    return flag or 2


def v3_help(state_dir: Path) -> str | None:
    """What ``-p 3 -h`` prints on this node (None: the driver has no protocol 3)."""
    root = SimNodeDir(state_dir)
    gpu = Connection(root.socket)
    try:
        info = gpu.call({"op": "node"})
    finally:
        gpu.close()
    return V3_HELP if info.get("mps_v3") else None


def serve_mps(state_dir: Path, environ: Mapping[str, str], protocol: int = 2) -> int:
    """Run the stand-in daemon until stopped; the exit status."""
    uuid = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    pipe = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR)
    logs = Path(environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIR)
    root = SimNodeDir(state_dir)
    node = root.read_node()
    index = next((g.index for g in node.gpus if g.uuid == uuid), None)
    if index is None or "," in uuid:
        raise SimulationError(
            f"CUDA_VISIBLE_DEVICES={uuid!r}: the stand-in MPS daemon serves exactly one GPU of "
            f"{node.node_name}, named by its UUID ({', '.join(g.uuid for g in node.gpus)})"
        )
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    control = pipe / "control"
    control.unlink(missing_ok=True)
    # Bound under another name and renamed once the GPU is ours (EXCLUSIVE_PROCESS): a client
    # that sees `control` finds a daemon that serves, not one still attaching.
    binding = pipe / f".control.{os.getpid()}"
    binding.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(binding))
    listener.listen(16)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    with (logs / "control.log").open("a") as journal:

        def note(text: str) -> None:
            journal.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')} Control {os.getpid()}] {text}\n")
            journal.flush()

        gpu = Connection(root.socket)
        try:
            gpu.call({"op": "mps_attach", "gpu": index, "pipe": str(pipe), "protocol": protocol})
            binding.rename(control)
            note(
                f"Starting control daemon (protocol {protocol}) using socket {control} "
                f"for GPU {index} ({uuid})"
            )
            return _run(listener, gpu, note)
        finally:
            gpu.close()
            listener.close()
            binding.unlink(missing_ok=True)
            control.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (pipe / PID_FILE).unlink()


def _run(listener: socket.socket, gpu: Connection, note: Callable[[str], None]) -> int:
    def stop(_signum: int, _frame: FrameType | None) -> None:
        raise _Stop

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        while True:
            readable, _, _ = select.select([listener.fileno(), gpu.fileno()], [], [])
            if listener.fileno() in readable:
                conn, _ = listener.accept()
                with conn:
                    if _serve_commands(conn, gpu, note):
                        note("Shutting down (quit)")
                        return 0
            if gpu.fileno() in readable:
                note("the GPU server went away: exiting")
                return 1
    except _Stop:
        note("Shutting down")
        return 0


def _serve_commands(conn: socket.socket, gpu: Connection, note: Callable[[str], None]) -> bool:
    """Answer one connection's command lines; whether ``quit`` was among them."""
    conn.settimeout(COMMAND_TIMEOUT_S)
    owner = _peer_uid(conn) == os.getuid()
    data = b""
    with contextlib.suppress(OSError):  # a client that sends nothing, or goes, is dropped
        while len(data) <= MAX_COMMAND_BYTES and not data.endswith(b"\n\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    quit_asked = False
    for raw in data.decode(errors="replace").splitlines()[:64]:
        line = raw.strip()
        if not line:
            continue
        note(f"Command: {line[:200]}")
        reply = gpu.call({"op": "mps_command", "command": line[:1024], "owner": owner})
        quit_asked = quit_asked or bool(reply.get("quit"))
        with contextlib.suppress(OSError):
            conn.sendall((str(reply.get("reply", "")) + "\n\n").encode())
        if quit_asked:
            break
    return quit_asked


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


def send_commands(pipe: Path, lines: list[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> list[str]:
    """Send control commands to the daemon at ``pipe``, as ``nvidia-cuda-mps-control`` does
    with commands on its stdin; each command's reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(pipe / "control"))
        sock.sendall(("".join(f"{line}\n" for line in lines) + "\n").encode())
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    return [r.strip("\n") for r in data.decode(errors="replace").split("\n\n")[: len(lines)]]
