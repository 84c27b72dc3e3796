"""A simulated GPU node for machines without GPUs (demo, tests, CI).

Each simulated GPU is backed by one CPU core. Workload processes launched for a
GPU pin themselves to its core; a workload's "SM utilization" is its real share
of CPU time, read from /proc/<pid>/stat over each sampling window, and its "GPU
memory" is what it declares. Freezing or throttling a workload therefore really
lowers what the simulator reports, exactly as NVML would on a GPU.

Topology of the simulated node: GPUs are split over two NUMA nodes when there are
four or more; GPUs 2k and 2k+1 on one NUMA node share a PCIe switch and, for
NVLink-capable models (H100, A100, ...), NVLinks; other GPUs on the same NUMA node
meet at the NUMA node; GPUs on different NUMA nodes meet across sockets.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.errors import GpuLostError, NoSuchGpuError, ProcessGoneError, SimulationError
from agent.platform.gpu.inventory import (
    DeviceEvent,
    EventKind,
    GpuInfo,
    Link,
    ProcessMemory,
    ProcessSample,
    Topology,
    TopologyLevel,
)
from agent.platform.gpu.simspec import SimGpuModel, parse_simulate_spec
from agent.platform.gpu.simstate import SimGpuSlot, SimNode, SimStateDir
from agent.platform.procfs import ProcessIdentity, ProcFS

log = logging.getLogger(__name__)

_UUID_NAMESPACE = uuid.UUID("6f0c2d9e-4c1f-4b7a-9a57-0e6d8f3b2a10")
_MIB = 1024 * 1024
_SAMPLES_KEPT = 512


def sim_numa_nodes(count: int) -> list[int]:
    sockets = 2 if count >= 4 else 1
    return [i * sockets // count for i in range(count)]


def sim_topology(models: Sequence[SimGpuModel]) -> Topology:
    numa = sim_numa_nodes(len(models))
    links: dict[tuple[int, int], Link] = {}
    for a in range(len(models)):
        for b in range(a + 1, len(models)):
            if numa[a] != numa[b]:
                links[(a, b)] = Link(TopologyLevel.SYSTEM)
            elif a // 2 == b // 2:
                same_model = models[a].short_name == models[b].short_name
                nvlinks = models[a].pair_nvlinks if same_model else 0
                links[(a, b)] = Link(TopologyLevel.SINGLE_SWITCH, nvlinks)
            else:
                links[(a, b)] = Link(TopologyLevel.NODE)
    return Topology(links)


def sim_uuid(node_name: str, index: int, model: SimGpuModel) -> str:
    return "GPU-" + str(uuid.uuid5(_UUID_NAMESPACE, f"{node_name}/{index}/{model.short_name}"))


class SimulatedBackend:
    """``GpuBackend`` over CPU cores; see the module docstring."""

    def __init__(
        self,
        spec: str,
        node_name: str,
        state_dir: Path,
        *,
        cores: Sequence[int] | None = None,
        procfs: ProcFS | None = None,
        clock: Clock | None = None,
        sample_period_s: float = 0.2,
        event_poll_s: float = 0.05,
    ) -> None:
        models = parse_simulate_spec(spec)
        cpus = sorted(cores) if cores else sorted(os.sched_getaffinity(0))
        if not cpus:
            raise SimulationError("no CPU cores to back the simulated GPUs")
        if len(models) > len(cpus):
            log.warning(
                "%d simulated GPUs share %d CPU cores: utilization of GPUs on one core is not independent",
                len(models),
                len(cpus),
            )
        numa = sim_numa_nodes(len(models))
        self._gpus = tuple(
            GpuInfo(
                index=i,
                uuid=sim_uuid(node_name, i, m),
                model=m.product_name,
                memory_mib=m.memory_mib,
                minor=i,
                pci_bus_id=f"00000000:{(0x18 + 0x10 * i) % 0x100:02X}:00.0",
                numa_node=numa[i],
            )
            for i, m in enumerate(models)
        )
        self._topology = sim_topology(models)
        self._cores = [cpus[i % len(cpus)] for i in range(len(models))]
        self._procfs = procfs or ProcFS()
        self._clock = clock or SystemClock()
        self._hz = ProcFS.clock_ticks_per_second()
        self._period = sample_period_s
        self._poll = event_poll_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._lost: set[int] = set()
        self._readings: dict[ProcessIdentity, tuple[float, int]] = {}
        self._samples = {g.index: collections.deque[ProcessSample](maxlen=_SAMPLES_KEPT) for g in self._gpus}
        self._current = {g.index: 0 for g in self._gpus}
        self._memory: dict[int, list[ProcessMemory]] = {g.index: [] for g in self._gpus}
        self._last_refresh = float("-inf")
        self._launched: list[subprocess.Popen[bytes]] = []
        self.state = SimStateDir(state_dir)
        self._claim_state_dir(node_name)

    def _claim_state_dir(self, node_name: str) -> None:
        self.state.create()
        try:
            previous = self.state.read_node()
        except SimulationError:
            previous = None
        if previous and previous.agent_pid != os.getpid() and _pid_alive(previous.agent_pid):
            raise SimulationError(
                f"another simulated node (agent pid {previous.agent_pid}) uses {self.state.root}; "
                "stop it or pass a different --sim-state-dir"
            )
        slots = tuple(SimGpuSlot(g.index, g.uuid, self._cores[g.index]) for g in self._gpus)
        self.state.write_node(SimNode(node_name, os.getpid(), slots))
        self.state.take_events()  # events left by an earlier run are stale

    # GpuBackend ------------------------------------------------------------
    @property
    def name(self) -> str:
        return "simulated"

    def gpus(self) -> Sequence[GpuInfo]:
        return self._gpus

    def topology(self) -> Topology:
        return self._topology

    def core_of(self, index: int) -> int:
        self._check_index(index)
        return self._cores[index]

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        deadline = self._clock.monotonic() + timeout_s
        while not self._closed.is_set():
            events = [e for e in self.state.take_events() if self._known_event(e)]
            if events:
                with self._lock:
                    for e in events:
                        if e.kind is EventKind.LOST:
                            self._lost.add(e.gpu_index)
                        elif e.kind is EventKind.RECOVERED:
                            self._lost.discard(e.gpu_index)
                return events
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                break
            self._closed.wait(min(self._poll, remaining))
        return []

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        self._check_usable(index)
        self._refresh()
        with self._lock:
            return [s for s in self._samples[index] if s.timestamp_us > since_us]

    def process_memory(self, index: int) -> list[ProcessMemory]:
        self._check_usable(index)
        self._refresh()
        with self._lock:
            return list(self._memory[index])

    def device_utilization(self, index: int) -> int:
        self._check_usable(index)
        self._refresh()
        with self._lock:
            return min(100, self._current[index])

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for proc in self._launched:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._launched:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            if self.state.read_node().agent_pid == os.getpid():
                self.state.remove_node()
        except SimulationError:
            pass  # already gone: nothing of ours to remove

    # Workloads -------------------------------------------------------------
    def launch_workload(
        self,
        gpu: int,
        memory_mib: int,
        busy: float,
        duration_s: float | None = None,
        *,
        grow_to_mib: int | None = None,
        grow_after_s: float = 0.0,
    ) -> subprocess.Popen[bytes]:
        """Start ``vcuda-agent sim-workload`` for ``gpu``; it is stopped at ``close()``.

        With ``grow_to_mib`` the workload declares that much memory after ``grow_after_s``
        (the CLI's --grow-to-mib / --grow-after)."""
        self._check_index(gpu)
        cmd = [
            sys.executable,
            "-m",
            "agent",
            "sim-workload",
            "--sim-state-dir",
            str(self.state.root),
        ]
        cmd += ["--gpu", str(gpu), "--memory-mib", str(memory_mib), "--busy", str(busy)]
        if duration_s is not None:
            cmd += ["--duration", str(duration_s)]
        if grow_to_mib is not None:
            cmd += ["--grow-to-mib", str(grow_to_mib), "--grow-after", str(grow_after_s)]
        proc = subprocess.Popen(cmd)
        self._launched.append(proc)
        return proc

    # Sampling --------------------------------------------------------------
    def _refresh(self) -> None:
        """Take a reading of every workload if the last one is a sampling period old."""
        with self._lock:
            now = self._clock.monotonic()
            if now - self._last_refresh < self._period:
                return
            self._last_refresh = now
            now_us = int(self._clock.wall() * 1_000_000)
            current = dict.fromkeys(self._current, 0)
            memory: dict[int, list[ProcessMemory]] = {i: [] for i in self._memory}
            seen: set[ProcessIdentity] = set()
            for proc in self.state.processes():
                ident = ProcessIdentity(proc.pid, proc.start_ticks)
                try:  # one read of /proc/<pid>/stat: is it the same process, and its CPU time
                    stat = self._procfs.stat(proc.pid) if proc.gpu in current else None
                except ProcessGoneError:
                    stat = None
                if stat is None or stat.start_ticks != proc.start_ticks or stat.state in ("Z", "X"):
                    self.state.unregister_process(proc.pid)
                    continue
                ticks = stat.cpu_ticks
                seen.add(ident)
                memory[proc.gpu].append(ProcessMemory(proc.pid, proc.memory_mib * _MIB))
                previous = self._readings.get(ident)
                self._readings[ident] = (now, ticks)
                if previous is None or now <= previous[0]:
                    continue
                share = (ticks - previous[1]) / ((now - previous[0]) * self._hz)
                util = max(0, min(100, round(share * 100)))
                self._samples[proc.gpu].append(ProcessSample(proc.pid, now_us, util))
                current[proc.gpu] += util
            self._readings = {k: v for k, v in self._readings.items() if k in seen}
            self._current, self._memory = current, memory

    def _known_event(self, event: DeviceEvent) -> bool:
        if 0 <= event.gpu_index < len(self._gpus):
            return True
        log.warning(
            "ignoring simulated event for GPU %d: the node has GPUs 0..%d",
            event.gpu_index,
            len(self._gpus) - 1,
        )
        return False

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._gpus):
            raise NoSuchGpuError(f"no GPU {index}: the simulated node has GPUs 0..{len(self._gpus) - 1}")

    def _check_usable(self, index: int) -> None:
        self._check_index(index)
        with self._lock:
            if index in self._lost:
                raise GpuLostError(index, "fell off the bus (simulated)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
