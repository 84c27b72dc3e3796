"""Clients of the GPU server (:mod:`.server`): a workload's context, and the node's view
used by the agent's backend, ``sim-event``, tests and benches."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import SimulationError
from agent.platform.gpu.sim.protocol import LineBuffer, decode, encode

READ_SIZE = 65536


class ServerGone(SimulationError):
    """The GPU server closed the connection (it stopped, or the GPU is gone)."""


class Connection:
    """One blocking connection to the server; requests are answered in order."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0) -> None:
        self.path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(socket_path))
        except OSError as err:
            self._sock.close()
            raise SimulationError(f"cannot reach the simulated GPUs at {socket_path}: {err}") from err
        self._buffer = LineBuffer()
        self._lines: list[bytes] = []

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        try:
            self._sock.sendall(encode(message))
        except OSError as err:
            raise ServerGone(f"the simulated GPUs at {self.path} went away: {err}") from err

    def receive(
        self, timeout_s: float | None = None, interrupted: Callable[[], bool] | None = None
    ) -> dict[str, Any]:
        """The next message; waits up to ``timeout_s`` (None: for ever), in slices of 0.25 s
        so that ``interrupted`` (e.g. a stop flag) is looked at while a call blocks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._lines:
            wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError("no reply from the simulated GPUs")
            if interrupted is not None and interrupted():
                raise InterruptedError("interrupted while waiting for the simulated GPUs")
            readable, _, _ = select.select([self._sock], [], [], wait)
            if not readable:
                continue
            try:
                data = self._sock.recv(READ_SIZE)
            except OSError as err:
                raise ServerGone(f"the simulated GPUs at {self.path} went away: {err}") from err
            if not data:
                raise ServerGone(f"the simulated GPUs at {self.path} closed the connection")
            self._lines += self._buffer.feed(data)
        return decode(self._lines.pop(0))

    def call(self, message: dict[str, Any], interrupted: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send a request and return its reply; an error reply raises SimulationError."""
        self.send(message)
        reply = self.receive(None, interrupted)
        if not reply.get("ok"):
            raise SimulationError(str(reply.get("error") or f"{message.get('op')} failed"))
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class ContextClient:
    """A workload process's CUDA context on one simulated GPU. Its calls block as CUDA's
    do: a launch until its kernels are queued, a sync until the queue is empty."""

    def __init__(
        self,
        socket_path: Path,
        gpu: int,
        share_percent: float = 100.0,
        *,
        mps_pipe: str = "",
        memory_limit_mib: int | None = None,
        mig: str = "",
    ) -> None:
        """``mig``: the UUID of a MIG device of the GPU to run on (a GPU in MIG mode runs
        work only there)."""
        self._conn = Connection(socket_path)
        self.interrupted: Callable[[], bool] | None = None
        request: dict[str, Any] = {"op": "open", "gpu": gpu, "share": share_percent}
        if mig:
            request["mig"] = mig
        if mps_pipe:
            request["mps_pipe"] = mps_pipe
        if memory_limit_mib is not None:
            request["memory_limit_mib"] = memory_limit_mib
        try:
            self.context = int(self._conn.call(request)["context"])
        except SimulationError:
            self._conn.close()
            raise

    def launch(self, count: int, kernel_s: float) -> None:
        self._conn.call({"op": "launch", "count": count, "kernel_ms": kernel_s * 1000}, self.interrupted)

    def graph(self, kernels: int, kernel_s: float) -> None:
        self._conn.call({"op": "graph", "kernels": kernels, "kernel_ms": kernel_s * 1000}, self.interrupted)

    def sync(self) -> None:
        self._conn.call({"op": "sync"}, self.interrupted)

    def alloc(self, mib: int) -> None:
        self._conn.call({"op": "alloc", "mib": mib}, self.interrupted)

    def close(self) -> None:
        self._conn.close()


class NodeClient:
    """The node's view: what NVML would report, ground truth, health events."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0) -> None:
        self._conn = Connection(socket_path, timeout_s)

    def poll(self, since_us: dict[int, int], device_since_us: dict[int, int]) -> list[dict[str, Any]]:
        """Every GPU's driver samples newer than ``since_us`` and device samples newer than
        ``device_since_us`` (per GPU index), utilization, memory and state."""
        reply = self._conn.call(
            {
                "op": "poll",
                "since": {str(k): v for k, v in since_us.items()},
                "device_since": {str(k): v for k, v in device_since_us.items()},
            }
        )
        return list(reply["gpus"])

    def truth(self) -> dict[str, Any]:
        return self._conn.call({"op": "truth"})

    def node_info(self) -> dict[str, Any]:
        return self._conn.call({"op": "node"})

    def set_memory_limit(self, gpu: int, cgroup: str, mib: int | None) -> None:
        self._conn.call({"op": "memlimit", "gpu": gpu, "cgroup": cgroup, "mib": mib})

    def post_event(
        self,
        gpu: int,
        kind: str,
        xid: int | None = None,
        detail: str = "",
        *,
        gpu_instance: int | None = None,
    ) -> None:
        """``gpu_instance``: the MIG GPU instance an XID is attributed to."""
        request: dict[str, Any] = {"op": "event", "gpu": gpu, "kind": kind, "xid": xid, "detail": detail}
        if gpu_instance is not None:
            request["gi"] = gpu_instance
        self._conn.call(request)

    def mig_state(self) -> list[dict[str, Any]]:
        """Every GPU's MIG mode and devices (``mig_state``)."""
        return list(self._conn.call({"op": "mig_state"})["gpus"])

    def mig_truth(self) -> dict[str, Any]:
        """Exact figures per MIG device (``mig_truth``)."""
        return self._conn.call({"op": "mig_truth"})

    def gpu_reset(self, gpu: int) -> dict[str, Any]:
        """Reset a GPU: its pending MIG mode applies and its MIG instances go (``gpu_reset``)."""
        return self._conn.call({"op": "gpu_reset", "gpu": gpu})

    def hang(self, gpu: int, call: str, seconds: float) -> None:
        """Fault injection: the agent's ``call`` on ``gpu`` blocks for ``seconds``."""
        self._conn.call({"op": "hang", "gpu": gpu, "call": call, "seconds": seconds})

    def subscribe(self) -> None:
        self._conn.send({"op": "subscribe"})

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        """The next pushed event (after ``subscribe``), or None after ``timeout_s``."""
        try:
            message = self._conn.receive(timeout_s)
        except TimeoutError:
            return None
        event = message.get("event")
        if not isinstance(event, dict):
            raise SimulationError(f"unexpected message on the event stream: {message}")
        return event

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        self._conn.close()


def context_times(truth: dict[str, Any]) -> dict[int, float]:
    """GPU seconds each process (by pid) has run, from a ``truth`` reply."""
    return {int(c["pid"]): float(c["ran_s"]) for g in truth["gpus"] for c in g["contexts"]}


def post_event(
    sim_dir: Path,
    gpu: int,
    kind: str,
    xid: int | None = None,
    detail: str = "",
    *,
    gpu_instance: int | None = None,
) -> None:
    """Inject a health event into the simulated node served in ``sim_dir`` (``sim-event``)."""
    client = NodeClient(sim_dir / "gpu.sock")
    try:
        client.post_event(gpu, kind, xid, detail, gpu_instance=gpu_instance)
    finally:
        client.close()


def server_accepts(socket_path: Path) -> bool:
    """Whether a GPU server listens on ``socket_path`` (it may not answer yet)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(socket_path))
        except OSError:
            return False
    return True


def server_answers(socket_path: Path) -> bool:
    """Whether the GPU server on ``socket_path`` answers a request."""
    try:
        conn = Connection(socket_path, timeout_s=2.0)
    except SimulationError:
        return False
    try:
        conn.call({"op": "node"})
        return True
    except (SimulationError, TimeoutError):
        return False
    finally:
        conn.close()
