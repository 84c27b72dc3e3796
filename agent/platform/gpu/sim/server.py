"""The GPU server: the simulated GPUs of one node and their driver, in a process of its own.

It runs outside every workload's cgroup (``vcuda-agent sim-gpu``, started by the agent or a
test rig): freezing a workload stops the workload, never the GPU, which goes on executing
what the workload queued. One thread, one ``selectors`` loop; it sleeps until a request
comes or until a blocked call (a launch into a full queue, a sync) can return, which the
engine computes ahead (:meth:`GpuEngine.when_completed`): no polling, no CPU spent while
nothing happens. The wire format is in :mod:`.protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.errors import SimulationError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.migprofiles import MigProduct
from agent.platform.gpu.sim.calls import BlockedCall
from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.contextopen import open_context, open_reply, parse_open
from agent.platform.gpu.sim.driverstate import DriverState
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import OutOfMemory
from agent.platform.gpu.sim.mig import MigError
from agent.platform.gpu.sim.migcalls import nvml_reply
from agent.platform.gpu.sim.migops import MigHost, mig_memory
from agent.platform.gpu.sim.nodefile import SimNode, SimNodeDir
from agent.platform.gpu.sim.protocol import LineBuffer, decode, encode
from agent.platform.gpu.sim.replies import (
    RequestError,
    gpu_field,
    hang_request,
    int_field,
    poll_reply,
    truth_reply,
)
from agent.platform.procfs import ProcFS

log = logging.getLogger(__name__)

MIB = 1 << 20
BACKLOG = 256
READ_SIZE = 65536
_PEERCRED = struct.Struct("3i")


@dataclass
class Peer:
    """One client connection (a workload's context, the agent's backend, a tool)."""

    sock: socket.socket
    pid: int
    uid: int = 0
    buffer: LineBuffer = field(default_factory=LineBuffer)
    out: bytearray = field(default_factory=bytearray)
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    gpu: int = -1
    key: int | str = -1  # its context's engine: the GPU's index, or the MIG device's UUID
    rate: float = 1.0  # the engine's share of the whole GPU's throughput (a MIG device's < 1)
    ctx: Context | None = None
    call: BlockedCall | None = None
    wake_at: float = math.inf
    subscribed: bool = False
    closing: bool = False
    waiting: dict[str, Any] | None = None  # an open waiting for another user id's MPS server


class GpuServer:
    """Serves ``node``'s GPUs on ``<dir>/gpu.sock`` until :meth:`stop`."""

    def __init__(
        self,
        node: SimNode,
        configs: Sequence[EngineConfig],
        root: SimNodeDir,
        *,
        memory_limits: bool = False,
        mps_v3: bool = False,
        mig_products: Sequence[MigProduct | None] = (),
        mig_geometry: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """``memory_limits``: the driver has per-cgroup memory limits (R615+); without, the
        ``memlimit`` op fails as nvmlDeviceSetMemoryLimits_v1 does on an older driver.
        ``mps_v3``: its MPS control daemon speaks protocol 3 (namespaces bound to cgroups).
        ``mig_products``: each GPU's MIG tables (None or missing: no MIG); ``mig_geometry``:
        GPUs in MIG mode from the start, each with its GPU instances' profile names."""
        if len(configs) != len(node.gpus):
            raise SimulationError(f"{len(configs)} engine configs for {len(node.gpus)} GPUs")
        self.node = node
        self.root = root
        now = time.monotonic()
        self._wall_offset = time.time() - now
        self.engines = [GpuEngine(c, now, self._wall_offset, index=i) for i, c in enumerate(configs)]
        self._selector = selectors.DefaultSelector()
        self._peers: dict[int, Peer] = {}
        self._dirty: set[int | str] = set()  # engines whose blocked calls need a new prediction
        self._procfs = ProcFS()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._listener: socket.socket | None = None
        self.driver = DriverState(
            self.engines, memory_limits=memory_limits, proc_root=self._procfs.root, mps_v3=mps_v3
        )
        self._hangs: dict[int, tuple[str, float]] = {}  # GPU -> (NVML call, monotonic end): ``hang``
        self.mig = MigHost(node, configs, self.engines, self._wall_offset, mig_products)
        for gpu, profiles in (mig_geometry or {}).items():
            self.mig.enable(gpu, profiles, now)

    # Lifecycle ------------------------------------------------------------------------------
    def listen(self) -> None:
        """Bind the socket and publish node.json (clients may connect from then on)."""
        self.root.create()
        self.root.socket.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.root.socket))
            listener.listen(BACKLOG)
        except OSError as err:
            listener.close()
            raise SimulationError(f"cannot listen on {self.root.socket}: {err}") from err
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.root.write_node(self.node)

    def watch_fd(self, fd: int) -> None:
        """Stop when ``fd`` (the read end of a pipe whose writer is the parent) closes."""
        self._selector.register(fd, selectors.EVENT_READ, "parent")

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler or another thread)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def serve(self) -> None:
        if self._listener is None:
            self.listen()
        try:
            while not self._stopping.is_set():
                self._step()
        finally:
            self._close()

    def _close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        if self._listener is not None:
            self._listener.close()
        self.root.remove_node(self.node.server_pid)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # The loop -------------------------------------------------------------------------------
    def _step(self) -> None:
        wake = min((p.wake_at for p in self._peers.values()), default=math.inf)
        timeout = None if wake == math.inf else max(0.0, wake - time.monotonic())
        for key, mask in self._selector.select(timeout):
            if key.data == "listener":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
            elif key.data == "parent":
                if not os.read(key.fd, 64):
                    log.info("the process that started the simulated GPUs exited: stopping")
                    self._stopping.set()
            else:
                peer = self._peers.get(key.fd)
                if peer is not None:
                    if mask & selectors.EVENT_READ:
                        self._read(peer)
                    if mask & selectors.EVENT_WRITE and not peer.closing:
                        self._flush(peer)
        self._wake_blocked()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()  # type: ignore[union-attr]
            except BlockingIOError:
                return
            except OSError as err:
                log.warning("accept failed: %s", err)
                return
            pid, uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            sock.setblocking(False)
            peer = Peer(sock, pid, uid)
            self._peers[sock.fileno()] = peer
            self._selector.register(sock, selectors.EVENT_READ, "peer")

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        try:
            for line in peer.buffer.feed(data):
                peer.requests.append(decode(line))
        except SimulationError as err:
            self._reply(peer, {"ok": False, "error": str(err)})
            peer.closing = True
            self._drop(peer)
            return
        self._serve_requests(peer)

    def _serve_requests(self, peer: Peer) -> None:
        """Answer queued requests in order, stopping at one that blocks."""
        while peer.requests and peer.call is None and peer.waiting is None and peer.sock.fileno() >= 0:
            request = peer.requests.popleft()
            try:
                reply = self._handle(peer, request)
            except MigError as err:  # NVML's return code goes with it
                reply = {"ok": False, "error": str(err), "nvml": err.code}
            except RequestError as err:
                reply = {"ok": False, "error": str(err)}
            if reply is not None:
                self._reply(peer, reply)

    def _wake_blocked(self) -> None:
        now = time.monotonic()
        for peer in [p for p in self._peers.values() if p.call is not None and p.wake_at <= now]:
            self._progress(peer, now)
        for gpu in list(self._dirty):
            self._predict(gpu)
        self._dirty.clear()

    def _progress(self, peer: Peer, now: float) -> None:
        assert peer.call is not None and peer.ctx is not None
        engine = self._engine(peer.key)
        queued = peer.ctx.queued
        if peer.call.progress(engine, peer.ctx, now):
            peer.call, peer.wake_at = None, math.inf
            self._reply(peer, {"ok": True, "queued": peer.ctx.queued})
            self._serve_requests(peer)
        elif peer.ctx.queued == queued and engine.lost is False:
            peer.wake_at = now + 1e-4  # predicted a hair early: look again shortly
        self._dirty.add(peer.key)

    def _engine(self, key: int | str) -> GpuEngine:
        """The engine behind a peer's key: a GPU's, or a MIG device's."""
        return self.engines[key] if isinstance(key, int) else self.mig.device(key).engine

    def _predict(self, key: int | str) -> None:
        if isinstance(key, str) and key not in self.mig.devices:
            return  # the MIG device is gone (it had no context left)
        engine = self._engine(key)
        blocked = [
            (p, p.call, p.ctx)
            for p in self._peers.values()
            if p.key == key and p.call is not None and p.ctx is not None
        ]
        if not blocked:
            return
        times = engine.when_completed({ctx.cid: call.awaits(engine, ctx) for _, call, ctx in blocked})
        for peer, _, ctx in blocked:
            peer.wake_at = times.get(ctx.cid, math.inf)

    # Requests -------------------------------------------------------------------------------
    def _handle(self, peer: Peer, request: dict[str, Any]) -> dict[str, Any] | None:
        op = request.get("op")
        now = time.monotonic()
        if op == "open":
            return self._open(peer, request, now)
        if op in ("launch", "graph", "sync", "alloc"):
            return self._context_call(peer, op, request, now)
        if op == "poll":
            return self._poll(request, now)
        if op == "nvml":
            return nvml_reply(self.mig, self.engines, request, now)
        if op == "mig_state":
            return self.mig.state_reply()
        if op == "mig_truth":
            return self.mig.truth_reply(now)
        if op == "gpu_reset":
            return self.mig.reset(request, now)
        if op == "mps_attach":
            if peer.ctx is not None:
                raise RequestError("this connection is already a context")
            gpu = self.driver.attach(peer.sock.fileno(), peer.pid, request, now)
            return {"ok": True, "gpu": gpu, "uuid": self.node.gpus[gpu].uuid}
        if op == "mps_command":
            return self._mps_command(peer, request)
        if op == "memlimit":
            self.driver.set_limit(request)
            return {"ok": True}
        if op == "truth":
            return truth_reply(self.engines, now, self._wall_offset)
        if op == "event":
            return self._event(request, now)
        if op == "hang":  # fault injection (sim-event --hang)
            gpu, hang = hang_request(request, self.engines, now)
            self._hangs[gpu] = hang
            return {"ok": True}
        if op == "subscribe":
            peer.subscribed = True
            for engine in self.engines:
                if engine.lost:
                    self._push(peer, {"gpu": engine.index, "kind": EventKind.LOST.value, "detail": "lost"})
            return None
        if op == "node":
            return {
                "ok": True,
                "node_name": self.node.node_name,
                "gpus": len(self.engines),
                "memory_limits": self.driver.limits_supported,
                "mps_v3": self.driver.mps_v3,
            }
        raise RequestError(f"unknown op {op!r}")

    def _open(self, peer: Peer, request: dict[str, Any], now: float) -> dict[str, Any] | None:
        if peer.ctx is not None:
            raise RequestError("this connection already has a context")
        req = parse_open(request, self.engines)
        mig = request.get("mig")
        if mig is not None:  # a context on a MIG device (CUDA_VISIBLE_DEVICES=MIG-...)
            dev, mig_ctx = self.mig.open_context(
                req.gpu, str(mig), self.driver, self._procfs, pid=peer.pid, now=now
            )
            peer.gpu, peer.key, peer.rate, peer.ctx = req.gpu, dev.uuid, dev.rate, mig_ctx
            return {**open_reply(mig_ctx, False), "mig": dev.uuid}
        if self.mig.in_mig_mode(req.gpu):
            raise RequestError(f"GPU {req.gpu} is in MIG mode: a context opens on one of its MIG devices")
        engine = self.engines[req.gpu]
        ctx = open_context(engine, self.driver, self._procfs, req, pid=peer.pid, uid=peer.uid, now=now)
        if ctx is None:
            log.info(
                "GPU %d: client %d (uid %d) waits for another user's MPS server", req.gpu, peer.pid, peer.uid
            )
            peer.waiting = request
            return None
        peer.gpu, peer.key, peer.ctx = req.gpu, req.gpu, ctx
        return open_reply(ctx, engine.mps)

    def _poll(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        """``poll``, with the memory that processes hold on each GPU's MIG devices."""
        reply = poll_reply(self.engines, request, now, self._hangs)
        for gpu in reply["gpus"]:
            extra = self.mig.memory_of(gpu["index"])
            if extra:
                gpu["memory"] = mig_memory(extra, gpu["memory"])
        return reply

    def _mps_command(self, peer: Peer, request: dict[str, Any]) -> dict[str, Any]:
        line = request.get("command")
        if not isinstance(line, str) or len(line) > 1024:
            raise RequestError("mps_command: command must be a line of text")
        owner = request.get("owner", True) is not False  # the daemon says who sent it
        gpu, reply, quit_asked = self.driver.mps_command(peer.sock.fileno(), line, owner)
        self._admit_waiting(gpu)
        return {"ok": True, "reply": reply, "quit": quit_asked}

    def _admit_waiting(self, gpu: int) -> None:
        """Opens that waited for another user id's MPS server, in arrival order."""
        for waiter in [p for p in self._peers.values() if p.waiting is not None]:
            request = waiter.waiting
            assert request is not None
            if request.get("gpu") != gpu or not self.driver.mps_may_admit(gpu, waiter.uid):
                continue
            waiter.waiting = None
            try:
                reply = self._open(waiter, request, time.monotonic())
            except RequestError as err:
                reply = {"ok": False, "error": str(err)}
            if reply is not None:
                self._reply(waiter, reply)
                self._serve_requests(waiter)

    def _context_call(
        self, peer: Peer, op: str, request: dict[str, Any], now: float
    ) -> dict[str, Any] | None:
        if peer.ctx is None:
            raise RequestError(f"{op} before open: no context on this connection")
        engine = self._engine(peer.key)
        if engine.lost:
            raise RequestError(f"GPU {peer.gpu} is lost (fell off the bus)")
        if op == "alloc":
            try:
                if isinstance(peer.key, str):
                    self.mig.allocate(peer.key, peer.ctx, int_field(request, "mib") * MIB)
                else:
                    engine.allocate(peer.ctx, int_field(request, "mib") * MIB)
            except OutOfMemory as err:
                raise RequestError(str(err)) from err
            return {"ok": True}
        if op == "sync":
            call = BlockedCall(sync=True)
        else:
            count = int_field(request, "count" if op == "launch" else "kernels")
            kernel_s = float(request.get("kernel_ms", -1)) / 1000
            if count < 1 or not 0 <= kernel_s <= 3600:
                raise RequestError(f"{op}: count must be >= 1 and kernel_ms 0..3600000")
            kernel_s /= peer.rate  # whole-GPU seconds, on the SMs this engine has
            call = (
                BlockedCall(left=count, each_s=kernel_s)
                if op == "launch"
                else BlockedCall(left=1, each_s=count * kernel_s)
            )
        queued = peer.ctx.queued
        done = call.progress(engine, peer.ctx, now)
        if peer.ctx.queued != queued:
            self._dirty.add(peer.key)
        if done:
            return {"ok": True, "queued": peer.ctx.queued}
        peer.call = call
        self._dirty.add(peer.key)
        return None

    def _event(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        gpu = gpu_field(request, self.engines)
        try:
            kind = EventKind(request.get("kind"))
        except ValueError as err:
            raise RequestError(f"event kind must be one of {[k.value for k in EventKind]}") from err
        xid = request.get("xid")
        if kind is EventKind.XID and not isinstance(xid, int):
            raise RequestError("an xid event needs an integer xid")
        detail = str(request.get("detail") or "injected")
        gi = self.mig.check_event_gi(gpu, request.get("gi")) if kind is EventKind.XID else None
        engine = self.engines[gpu]
        if kind in (EventKind.LOST, EventKind.RECOVERED):
            lost = kind is EventKind.LOST
            for ctx in engine.set_lost(lost, now) + self.mig.set_lost(gpu, lost, now):
                self._fail_context(ctx, f"GPU {gpu} is lost (fell off the bus)")
            self._dirty.add(gpu)
        event = {"gpu": gpu, "kind": kind.value, "xid": xid, "detail": detail}
        if gi is not None:
            event["gi"] = gi
        for peer in self._peers.values():
            if peer.subscribed:
                self._push(peer, event)
        return {"ok": True}

    def _fail_context(self, ctx: Context, error: str) -> None:
        for peer in self._peers.values():
            if peer.ctx is ctx:
                peer.ctx = None
                if peer.call is not None:
                    peer.call, peer.wake_at = None, math.inf
                    self._reply(peer, {"ok": False, "error": error})

    # Output ---------------------------------------------------------------------------------
    def _push(self, peer: Peer, event: dict[str, Any]) -> None:
        self._send(peer, encode({"event": event}))

    def _reply(self, peer: Peer, reply: dict[str, Any]) -> None:
        self._send(peer, encode(reply))

    def _send(self, peer: Peer, data: bytes) -> None:
        peer.out += data
        self._flush(peer)

    def _flush(self, peer: Peer) -> None:
        try:
            sent = peer.sock.send(peer.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(peer)
            return
        del peer.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(peer.sock, events, "peer")

    def _drop(self, peer: Peer) -> None:
        """The client went away: its context (a process's) is destroyed."""
        fd = peer.sock.fileno()
        if fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(peer.sock)
            self._peers.pop(fd, None)
        detached = self.driver.detach(fd, time.monotonic())
        if detached is not None:
            gpu, gone = detached
            for ctx in gone:
                self._fail_context(ctx, f"the MPS server of GPU {gpu} exited")
            for waiter in [p for p in self._peers.values() if p.waiting is not None]:
                if waiter.waiting is not None and waiter.waiting.get("gpu") == gpu:
                    waiter.waiting = None
                    self._reply(waiter, {"ok": False, "error": f"the MPS control daemon of GPU {gpu} exited"})
            self._dirty.add(gpu)
        peer.sock.close()
        if peer.waiting is not None:
            self.driver.mps_release(int(peer.waiting.get("gpu", -1)), peer.pid)
            peer.waiting = None
        if peer.ctx is not None:
            if isinstance(peer.key, int) or peer.key in self.mig.devices:
                self._engine(peer.key).destroy_context(peer.ctx, time.monotonic())
                self._dirty.add(peer.key)
            peer.ctx = None
            if isinstance(peer.key, int):  # a GPU's own context (MPS is not run on MIG devices)
                self.driver.mps_release(peer.gpu, peer.pid)
                self._admit_waiting(peer.gpu)
        peer.call, peer.wake_at = None, math.inf
