"""The short-lived BPF loader process: compile with bcc, load, hand the fds back, exit.

Run as ``python -m agent.platform.bpf.loader <socket fd>`` by :mod:`agent.platform.bpf.loaded`.
Compiling a BPF program with bcc maps libbcc and its LLVM/clang (about 120 MB touched) into the
process that does it; doing it here keeps them out of the long-running agent. The kernel objects
outlive this process: their fds travel to the agent over the unix socket (SCM_RIGHTS) and the
agent's copies keep them alive.

Wire format, both ways: a 4-byte big-endian length, then that many bytes of JSON; the answer's
fds ride on its first bytes. Request: ``{"text": str, "programs": [[name, kind]], "maps": [name]}``
with kind one of :data:`PROGRAM_KINDS`. Answer: ``{"ok": true, "programs": [...], "maps": [...]}``
(fds: the programs', then the maps', in request order), or ``{"ok": false, "stage": ..., "error":
..., "name": ...}`` with stage one of ``import``, ``compile``, ``load``, ``map``. bcc prints the
compiler's and the verifier's messages on stderr, which the parent keeps.

Only the standard library and bcc here: this module is imported by the agent too (for the wire
format) and must stay light.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import sys
from typing import Any

PROGRAM_KINDS = ("tracepoint", "kprobe", "cgroup_device", "lsm")
STAGES = ("import", "compile", "load", "map")
MAX_FDS = 64
_HEADER = struct.Struct("!I")


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    sent = 0
    if fds:  # the fds ride on the first bytes; a signal may cut a stream send short
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(data[sent:])


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it (close-on-exec). EOFError if the peer left."""
    fds: list[int] = []
    data = b""
    if max_fds:
        # Not socket.recv_fds: before Python 3.12 it drops its flags, and these fds must be
        # close-on-exec from the start (the agent starts other processes meanwhile).
        data, ancillary, _flags, _addr = sock.recvmsg(
            65536, socket.CMSG_SPACE(max_fds * array.array("i").itemsize), socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, blob in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(blob[: len(blob) - len(blob) % received.itemsize])
                fds.extend(received)
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError("the peer closed the socket without answering")
    try:
        while len(data) < _HEADER.size:
            data += _recv(sock, _HEADER.size - len(data))
        (length,) = _HEADER.unpack_from(data)
        while len(data) < _HEADER.size + length:
            data += _recv(sock, _HEADER.size + length - len(data))
        message = json.loads(data[_HEADER.size :])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _recv(sock: socket.socket, size: int) -> bytes:
    chunk = sock.recv(size)
    if not chunk:
        raise EOFError("the peer closed the socket mid-message")
    return chunk


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _failure(stage: str, err: BaseException, name: str = "") -> dict[str, Any]:
    return {"ok": False, "stage": stage, "error": _describe(err), "name": name}


def _load(request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    try:
        import bcc  # noqa: PLC0415  (this process exists to import it)

        if not hasattr(bcc, "BPF"):
            raise ImportError(f"the 'bcc' module at {bcc.__file__} is not BCC (the PyPI 'bcc' is unrelated)")
    except ImportError as err:
        return _failure("import", err), []

    class _NoAutoload(bcc.BPF):  # type: ignore[misc]
        # bcc loads and attaches kprobe__/tracepoint__/lsm__ functions in its constructor; the
        # agent attaches, so every program is only loaded here.
        def _trace_autoload(self) -> None:
            pass

    kinds = {
        "tracepoint": bcc.BPF.TRACEPOINT,
        "kprobe": bcc.BPF.KPROBE,
        "cgroup_device": bcc.BPF.CGROUP_DEVICE,
        "lsm": bcc.BPF.LSM,
    }
    try:
        module = _NoAutoload(text=request["text"].encode())
    except Exception as err:  # noqa: BLE001  (bcc raises bare Exception; diagnostics go to stderr)
        return _failure("compile", err), []
    programs, maps, fds = [], [], []
    for name, kind in request["programs"]:
        try:
            fn = module.load_func(name.encode(), kinds[kind])
        except Exception as err:  # noqa: BLE001  (bcc's only exception type; reported to the parent)
            return _failure("load", err, name), []
        programs.append({"name": name, "kind": kind})
        fds.append(fn.fd)
    for name in request["maps"]:
        try:
            table = module[name.encode()]
            maps.append(
                {
                    "name": name,
                    "type": int(table.ttype),
                    "key_size": _sizeof(table.Key),
                    "value_size": _sizeof(table.Leaf),
                    "max_entries": int(table.max_entries),
                }
            )
            fds.append(table.get_fd())
        except Exception as err:  # noqa: BLE001  (bcc's only exception type; reported to the parent)
            return _failure("map", err, name), []
    return {"ok": True, "programs": programs, "maps": maps}, fds


def _sizeof(ctype: Any) -> int:
    import ctypes  # noqa: PLC0415

    return ctypes.sizeof(ctype)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m agent.platform.bpf.loader <socket fd>", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(argv[0]))
    request, _ = recv_message(sock)
    answer, fds = _load(request)
    send_message(sock, answer, fds)
    sock.close()
    sys.stderr.flush()
    # Skip interpreter teardown: bcc's and LLVM's destructors only cost time, and the kernel
    # objects are safe in the parent's fds by now.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
