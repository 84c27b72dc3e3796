"""What the simulated driver keeps besides the engines: the MPS control daemon serving each
GPU (an attached daemon's connection and its :class:`~.mpscontrol.MpsControl` state) and
per-cgroup memory limits; and which cgroup a client process is in."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import PlatformError
from agent.platform.cgroups.layout import detect_layout
from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.mpscontrol import ClientLimits, MpsControl
from agent.platform.gpu.sim.replies import RequestError, gpu_field

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class MpsServer:
    pid: int
    pipe: str  # the control daemon's CUDA_MPS_PIPE_DIRECTORY
    conn: int  # the fd of its connection
    control: MpsControl


class DriverState:
    def __init__(
        self, engines: Sequence[GpuEngine], *, memory_limits: bool, proc_root: Path, mps_v3: bool = False
    ) -> None:
        """``mps_v3``: the driver is r615+/R620, its MPS control daemon speaks protocol 3
        (namespaces bound to cgroups: :mod:`.mpsnamespaces`)."""
        self._engines = engines
        self.memory_limits = memory_limits
        self.mps_v3 = mps_v3
        self._proc_root = proc_root
        self._v2_root = _v2_root()
        self._mps: dict[int, MpsServer] = {}

    @property
    def limits_supported(self) -> bool:
        return self.memory_limits and self._v2_root is not None

    # MPS ------------------------------------------------------------------------------------
    def attach(self, conn: int, pid: int, request: dict[str, Any], now: float) -> int:
        """The connection ``conn`` of process ``pid`` becomes the MPS server of a GPU."""
        gpu = gpu_field(request, self._engines)
        engine = self._engines[gpu]
        pipe = request.get("pipe")
        if not isinstance(pipe, str) or not pipe.startswith("/"):
            raise RequestError(f"mps_attach: pipe must be an absolute directory, got {pipe!r}")
        if engine.lost:
            raise RequestError(f"GPU {gpu} is lost (fell off the bus)")
        if gpu in self._mps:
            raise RequestError(f"GPU {gpu} already has an MPS server (pid {self._mps[gpu].pid})")
        protocol = request.get("protocol", 2)
        if protocol not in (2, 3) or isinstance(protocol, bool):
            raise RequestError(f"mps_attach: protocol must be 2 or 3, got {protocol!r}")
        if protocol == 3 and not self.mps_v3:
            raise RequestError("MPS protocol 3 needs an r615+ driver (start sim-gpu with --driver-mps-v3)")
        if any(s.conn == conn for s in self._mps.values()):
            raise RequestError("this connection is already an MPS server")
        others = [c.pid for c in engine.contexts]
        if others:
            raise RequestError(
                f"GPU {gpu} cannot go to EXCLUSIVE_PROCESS mode: processes {others} hold contexts on it"
            )
        engine.attach_mps_server(pid, now)
        self._mps[gpu] = MpsServer(pid, pipe, conn, MpsControl(pid, protocol))
        log.info(
            "GPU %d: MPS server pid %d attached (pipe directory %s, protocol %d)", gpu, pid, pipe, protocol
        )
        return gpu

    def detach(self, conn: int, now: float) -> tuple[int, list[Context]] | None:
        """The connection closed: if it served a GPU, the GPU and its clients' contexts (gone)."""
        gpu = next((g for g, s in self._mps.items() if s.conn == conn), None)
        if gpu is None:
            return None
        server = self._mps.pop(gpu)
        gone = self._engines[gpu].detach_mps_server(now)
        log.info(
            "GPU %d: MPS server pid %d went away; its %d clients' contexts are gone",
            gpu,
            server.pid,
            len(gone),
        )
        return gpu, gone

    def mps_client(self, gpu: int, pipe: str) -> bool:
        """Whether a new context on ``gpu`` is a client of its MPS server; refuses one that
        cannot run (EXCLUSIVE_PROCESS compute mode while a server holds the GPU)."""
        server = self._mps.get(gpu)
        if server is None:
            return False
        if pipe != server.pipe:
            raise RequestError(
                f"GPU {gpu} is in EXCLUSIVE_PROCESS mode for its MPS server (pid {server.pid}): only its "
                f"clients may use it (CUDA_MPS_PIPE_DIRECTORY={server.pipe}), this one came with "
                f"{pipe or 'no pipe directory'}"
            )
        return True

    def mps_admit(
        self, gpu: int, pid: int, uid: int, percentage: float | None, pinned: int | None
    ) -> ClientLimits | None:
        """A client of ``gpu``'s daemon starts: its limits, or None while it must wait (a
        server of another user id has clients). Its cgroup routes it on protocol 3."""
        return self._mps[gpu].control.admit(pid, uid, percentage, pinned, self.cgroup_of(pid))

    def mps_release(self, gpu: int, pid: int) -> None:
        server = self._mps.get(gpu)
        if server is not None:
            server.control.release(pid)

    def mps_may_admit(self, gpu: int, uid: int) -> bool:
        server = self._mps.get(gpu)
        return server is None or server.control.may_admit(uid)

    def mps_command(self, conn: int, line: str, owner: bool = True) -> tuple[int, str, bool]:
        """A control command the daemon on ``conn`` received (``owner``: from a peer of the
        daemon's own uid): (GPU, reply, quit asked)."""
        gpu = next((g for g, s in self._mps.items() if s.conn == conn), None)
        if gpu is None:
            raise RequestError("mps_command: this connection is not an MPS control daemon")
        control = self._mps[gpu].control
        reply = control.command(line, owner=owner)
        return gpu, reply, control.quit_requested

    # Memory limits --------------------------------------------------------------------------
    def set_limit(self, request: dict[str, Any]) -> None:
        """``memlimit``: as nvmlDeviceSetMemoryLimits_v1 on this driver."""
        if not self.memory_limits:
            raise RequestError(
                "nvmlDeviceSetMemoryLimits_v1: Function Not Found (the simulated driver predates "
                "per-cgroup memory limits: start sim-gpu with --driver-memory-limits)"
            )
        if self._v2_root is None:
            raise RequestError("nvmlDeviceSetMemoryLimits_v1: Not Supported (no cgroup v2 hierarchy)")
        gpu = gpu_field(request, self._engines)
        cgroup = request.get("cgroup")
        if not isinstance(cgroup, str) or not cgroup.startswith("/"):
            raise RequestError(f"memlimit: cgroup must be an absolute path, got {cgroup!r}")
        mib = request.get("mib")
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, int) or mib < 0):
            raise RequestError(f"memlimit: mib must be a non-negative integer or null, got {mib!r}")
        self._engines[gpu].set_cgroup_limit(cgroup.rstrip("/"), None if mib is None else mib * MIB)

    def cgroup_of(self, pid: int) -> str:
        """The process's cgroup v2 directory as a full path ("" when unknown)."""
        if self._v2_root is None:
            return ""
        try:
            lines = (self._proc_root / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return ""
        rel = next((line[3:] for line in lines if line.startswith("0::")), None)
        return "" if rel is None else str(self._v2_root / rel.lstrip("/")).rstrip("/")


def _v2_root() -> Path | None:
    try:
        return detect_layout().v2_root
    except PlatformError:
        return None
