"""``GpuBackend`` on the simulated GPU server: what NVML would report, read over its socket.

The agent attaches to the node's GPU server when one serves ``--sim-state-dir`` (a test rig
or the demo starts it, so that it outlives agent restarts, as a GPU does), or else starts
one as its child (``vcuda-agent sim-gpu``) that stops with it. One agent per simulated node:
``<dir>/agent.lock`` is held for the backend's life.

Reads are batched: one ``poll`` brings every GPU's new per-process samples, device
utilization and process memory, and serves the calls of the next ``refresh_s``.

Fault-injection knob: a hang injected into the GPU server (``sim-event --hang S --call
NAME``, the ``hang`` op) comes back with the polls, and the GPU's calls of that NVML name
then block in the calling thread until it ends, as a real driver stuck in an ioctl would.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from agent.clock import Clock, SystemClock
from agent.errors import GpuLostError, MemoryLimitUnsupportedError, NoSuchGpuError, SimulationError
from agent.platform.gpu.inventory import (
    CALL_DEVICE_SAMPLES,
    CALL_DEVICE_UTILIZATION,
    CALL_PROCESS_MEMORY,
    CALL_PROCESS_SAMPLES,
    DeviceEvent,
    DeviceSample,
    EventKind,
    GpuInfo,
    ProcessMemory,
    ProcessSample,
    Topology,
)
from agent.platform.gpu.migcontrol import MigControl
from agent.platform.gpu.migstate import MigDevice, MigInfo
from agent.platform.gpu.sim.client import NodeClient, server_accepts, server_answers
from agent.platform.gpu.sim.inventory import sim_gpus, sim_topology
from agent.platform.gpu.sim.migclient import SimNvml
from agent.platform.gpu.sim.nodefile import SimNode, SimNodeDir, pid_alive
from agent.platform.gpu.sim.nvmllib import process_utilization
from agent.platform.gpu.sim.perfmon import RING_SAMPLES, Sample
from agent.platform.gpu.sim.spec import parse_simulate_spec

log = logging.getLogger(__name__)

SAMPLES_KEPT = 4096  # per GPU
_Stamped = TypeVar("_Stamped", Sample, DeviceSample)
START_TIMEOUT_S = 20.0
MEMORY_FRESH_S = 0.005  # process_memory polls unless the last poll is this recent


class SimulatedBackend:
    """Simulated GPUs (see the module docstring)."""

    def __init__(
        self,
        spec: str,
        node_name: str,
        state_dir: Path,
        *,
        server_args: Sequence[str] = (),
        clock: Clock | None = None,
        refresh_s: float = 0.05,
    ) -> None:
        models = parse_simulate_spec(spec)
        self._gpus = sim_gpus(node_name, models)
        self._topology = sim_topology(models)
        self._clock = clock or SystemClock()
        self._refresh_s = refresh_s
        self.root = SimNodeDir(state_dir)
        self.root.create()
        self._lock_fd = self._claim()
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        try:
            self.node = self._attach_or_start(spec, node_name, server_args)
            self._poller = NodeClient(self.root.socket)
            self._events = NodeClient(self.root.socket)
            self._events.subscribe()
        except BaseException:
            self._release()
            raise
        self._since = {g.index: 0 for g in self._gpus}
        self._device_since = {g.index: 0 for g in self._gpus}
        # The driver's per-process samples as its ring holds them (the NVML library reads the
        # ring at each call): only the last RING_SAMPLES where the node runs the driver view.
        self._driver = {
            g.index: collections.deque[Sample](
                maxlen=RING_SAMPLES if self.node.gpu(g.index).ring else SAMPLES_KEPT
            )
            for g in self._gpus
        }
        self._device = {g.index: collections.deque[DeviceSample](maxlen=SAMPLES_KEPT) for g in self._gpus}
        self._utilization = {g.index: 0 for g in self._gpus}
        self._memory: dict[int, list[ProcessMemory]] = {g.index: [] for g in self._gpus}
        self._lost: set[int] = set()
        self._hangs: dict[int, tuple[str, float]] = {}  # GPU -> (NVML call or *, monotonic end)
        self._polled = float("-inf")
        self._nvml: SimNvml | None = None  # MIG writes (mig_control), opened at the first

    # Start-up ------------------------------------------------------------------------------
    def _claim(self) -> int:
        fd = os.open(self.root.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            os.close(fd)
            raise SimulationError(
                f"another agent uses the simulated node at {self.root.root}: stop it or pass a different "
                "--sim-state-dir"
            ) from err
        return fd

    def _attach_or_start(self, spec: str, node_name: str, server_args: Sequence[str]) -> SimNode:
        node = self._running_node()
        if node is not None:
            if node.spec != spec or node.node_name != node_name:
                raise SimulationError(
                    f"the simulated node at {self.root.root} is {node.spec} named {node.node_name}, "
                    f"not {spec} named {node_name}: stop its GPU server (pid {node.server_pid}) or pass "
                    "a different --sim-state-dir"
                )
            log.info(
                "simulated GPUs: attached to the GPU server (pid %d) at %s", node.server_pid, self.root.root
            )
            return node
        return self._start(spec, node_name, server_args)

    def _running_node(self) -> SimNode | None:
        """The node of a server that runs here, or None when none does. A server that is
        starting (its socket bound, node.json not yet written) or too busy to answer at once
        is waited for, never replaced: a second server would take the first one's socket."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                node: SimNode | None = self.root.read_node()
            except SimulationError:
                node = None
            if node is not None and pid_alive(node.server_pid) and server_answers(self.root.socket):
                return node
            if not server_accepts(self.root.socket) or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _start(self, spec: str, node_name: str, server_args: Sequence[str]) -> SimNode:
        read_end, write_end = os.pipe()  # the server stops when this process (the write end) is gone
        cmd = [sys.executable, "-m", "agent", "sim-gpu", "--simulate", spec, "--node-name", node_name]
        cmd += ["--sim-state-dir", str(self.root.root), "--exit-with-fd", str(read_end), *server_args]
        try:
            self._server = subprocess.Popen(cmd, pass_fds=(read_end,), start_new_session=True)
        finally:
            os.close(read_end)
        self._server_pipe = write_end
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                raise SimulationError(
                    f"the simulated GPU server exited with {self._server.returncode} at start"
                )
            with contextlib.suppress(SimulationError):
                node = self.root.read_node()
                if node.server_pid == self._server.pid and server_answers(self.root.socket):
                    log.info(
                        "simulated GPUs: started the GPU server (pid %d) at %s",
                        node.server_pid,
                        self.root.root,
                    )
                    return node
            time.sleep(0.02)
        raise SimulationError(f"the simulated GPU server did not start within {START_TIMEOUT_S:.0f} s")

    # GpuBackend ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "simulated"

    def gpus(self) -> Sequence[GpuInfo]:
        return self._gpus

    def topology(self) -> Topology:
        return self._topology

    def sample_period_s(self, index: int) -> float | None:
        self._check_index(index)
        return self.node.gpu(index).sample_period_s

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        if self._closed.is_set():
            return []
        try:
            raw = self._events.next_event(timeout_s)
        except SimulationError as err:
            if self._closed.is_set():
                return []
            raise SimulationError(f"the simulated GPUs' event stream broke: {err}") from err
        if raw is None:
            return []
        event = _event(raw)
        if event is None or not 0 <= event.gpu_index < len(self._gpus):
            log.warning("ignoring a malformed simulated event: %s", raw)
            return []
        with self._lock:
            if event.kind is EventKind.LOST:
                self._lost.add(event.gpu_index)
            elif event.kind is EventKind.RECOVERED:
                self._lost.discard(event.gpu_index)
        return [event]

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        """What ``nvmlDeviceGetProcessUtilization`` returns: the NVML library's aggregation
        (:mod:`.nvmllib`) of the driver's samples, as the node's GPU runs it."""
        self._refresh(index)
        self._stall(index, CALL_PROCESS_SAMPLES)
        with self._lock:
            newer = _tail(self._driver[index], since_us)
        slot = self.node.gpu(index)
        # The exact view has no driver ring: its samples pass through, as the engine's do.
        aggregation = slot.nvml_aggregation if slot.ring else "per-sample"
        return [
            ProcessSample(s.pid, s.timestamp_us, s.sm_util)
            for s in process_utilization(newer, since_us, aggregation)
        ]

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        self._refresh(index)
        self._stall(index, CALL_DEVICE_SAMPLES)
        with self._lock:
            return _tail(self._device[index], since_us)

    def process_memory(self, index: int) -> list[ProcessMemory]:
        # Fresher than the batched reads: NVML reads the driver's memory accounting at each
        # call, and a quota check near the line must not see memory 50 ms old.
        self._refresh(index, MEMORY_FRESH_S)
        self._stall(index, CALL_PROCESS_MEMORY)
        with self._lock:
            return list(self._memory[index])

    def device_utilization(self, index: int) -> int:
        self._refresh(index)
        self._stall(index, CALL_DEVICE_UTILIZATION)
        with self._lock:
            return self._utilization[index]

    def mig(self, index: int) -> MigInfo:
        """The GPU's MIG mode and devices, as the GPU server's driver holds them."""
        self._check_index(index)
        with self._lock:
            if index in self._lost:
                raise GpuLostError(index, "fell off the bus (simulated)")
            try:
                gpus = self._poller.mig_state()
            except SimulationError as err:
                raise SimulationError(f"cannot read the simulated GPUs' MIG state: {err}") from err
        raw = next((g for g in gpus if g.get("index") == index), None)
        if raw is None:
            raise SimulationError(f"the simulated GPU server reports no MIG state for GPU {index}")
        try:
            devices = tuple(MigDevice(**d) for d in raw["devices"])
            return MigInfo(bool(raw["capable"]), bool(raw["current"]), bool(raw["pending"]), devices)
        except (KeyError, TypeError) as err:
            raise SimulationError(f"malformed MIG state of GPU {index}: {err}") from err

    def mig_control(self) -> MigControl:
        """MIG changes through the GPU server's NVML calls (one client, for one caller at a time)."""
        with self._lock:
            if self._nvml is None:
                self._nvml = SimNvml(self.root.socket)
            return MigControl(self._nvml, lambda index: index, lambda _index: contextlib.nullcontext())

    def mps_control_command(self) -> list[str]:
        """The simulator's stand-in for ``nvidia-cuda-mps-control -f``."""
        return [
            sys.executable,
            "-m",
            "agent",
            "sim-mps-control",
            "-f",
            "--sim-state-dir",
            str(self.root.root),
        ]

    def memory_limits_support(self) -> str | None:
        """The GPU server says whether its driver has per-cgroup memory limits."""
        try:
            with self._lock:
                info = self._poller.node_info()
        except SimulationError as err:
            return f"cannot ask the simulated GPUs: {err}"
        if not info.get("memory_limits"):
            return "the simulated driver has no nvmlDeviceSetMemoryLimits_v1 (sim-gpu --driver-memory-limits)"
        return None

    def set_memory_limit(self, index: int, cgroup: Path, limit_bytes: int | None) -> None:
        self._check_index(index)
        mib = None if limit_bytes is None else limit_bytes // (1 << 20)
        try:
            with self._lock:
                self._poller.set_memory_limit(index, str(cgroup), mib)
        except SimulationError as err:
            raise MemoryLimitUnsupportedError(f"GPU {index}: cannot limit memory of {cgroup}: {err}") from err

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._nvml is not None:
            self._nvml.close()
        self._poller.close()
        self._events.close()
        self._release()

    def _release(self) -> None:
        if self._server is not None:
            os.close(self._server_pipe)
            self._server.terminate()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    # Reading -------------------------------------------------------------------------------
    def _refresh(self, index: int, max_age_s: float | None = None) -> None:
        """Poll the server unless the last poll is younger than ``max_age_s`` (default: the
        backend's ``refresh_s``)."""
        self._check_index(index)
        with self._lock:
            if index in self._lost:
                raise GpuLostError(index, "fell off the bus (simulated)")
            now = self._clock.monotonic()
            if now - self._polled < (self._refresh_s if max_age_s is None else max_age_s):
                return
            try:
                gpus = self._poller.poll(self._since, self._device_since)
            except SimulationError as err:
                raise SimulationError(f"cannot read the simulated GPUs: {err}") from err
            self._polled = now
            for gpu in gpus:
                self._take(gpu)

    def _take(self, gpu: dict[str, Any]) -> None:
        index = int(gpu["index"])
        driver = [Sample(int(p), int(t), int(u)) for p, t, u in gpu["driver"]]
        self._driver[index].extend(driver)
        if driver:
            self._since[index] = max(s.timestamp_us for s in driver)
        device = [DeviceSample(int(t), int(u)) for t, u in gpu["device"]]
        self._device[index].extend(device)
        if device:
            self._device_since[index] = max(s.timestamp_us for s in device)
        self._utilization[index] = int(gpu["utilization"])
        self._memory[index] = [ProcessMemory(int(p), int(b)) for p, b in gpu["memory"]]
        if gpu["lost"]:
            self._lost.add(index)
        else:
            self._lost.discard(index)
        hang = gpu.get("hang")
        if hang:
            self._hangs[index] = (str(hang[0]), self._clock.monotonic() + float(hang[1]))

    def _stall(self, index: int, call: str) -> None:
        """The injected hang, if one holds ``call`` on this GPU now: block until it ends (or
        the backend closes), outside the lock, so that only this call's thread is held."""
        with self._lock:
            hang = self._hangs.get(index)
        if hang is None or hang[0] not in (call, "*"):
            return
        left = hang[1] - self._clock.monotonic()
        if left > 0:
            log.info("GPU %d: %s hangs for %.1f s (injected)", index, call, left)
            self._closed.wait(left)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._gpus):
            raise NoSuchGpuError(f"no GPU {index}: the simulated node has GPUs 0..{len(self._gpus) - 1}")


def _tail(kept: collections.deque[_Stamped], since_us: int) -> list[_Stamped]:
    """The samples newer than ``since_us`` of a buffer kept in timestamp order (the server
    releases periods in order): only the new tail is read, not the whole history."""
    newer = list(itertools.takewhile(lambda s: s.timestamp_us > since_us, reversed(kept)))
    newer.reverse()
    return newer


def _event(raw: dict[str, Any]) -> DeviceEvent | None:
    try:
        xid, gi = raw.get("xid"), raw.get("gi")
        return DeviceEvent(
            gpu_index=int(raw["gpu"]),
            kind=EventKind(raw["kind"]),
            xid=None if xid is None else int(xid),
            detail=str(raw.get("detail") or "injected by the simulator"),
            gpu_instance=None if gi is None else int(gi),
        )
    except (KeyError, ValueError, TypeError):
        return None
