"""GPU memory quotas on the node: the driver limits each container's GPU memory where it
can (per-cgroup NVML limits); every ``memory_check_s`` (every ``memory_check_near_s`` while a
container is near its quota and growing: :mod:`agent.domain.memcadence`) the GPU memory of
each container (NVML per-process memory, sharpened by the ioctl tracer's allocation bytes)
is compared with its vcuda-memory, and the memory guard acts by mode (kill, deny, audit)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.control.driverlimits import DriverMemoryLimits
from agent.control.memguard import MemoryGuard, MemoryView, open_deny_program, process_uses
from agent.domain.memcadence import CadenceSettings, CheckCadence, Usage
from agent.domain.memquota import AllocationTimes, format_mib
from agent.domain.specs import EnforcementSpec
from agent.errors import VcudaError
from agent.platform.bpf.lsm import MemoryDenyProgram, probe_bpf_lsm
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import GpuBackend, GpuInfo, ProcessMemory
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.settings import EnforcementSettings, MemoryQuotaMode
from agent.surfaces.hostnode import HostIntegration
from agent.surfaces.kubenode import KubeIntegration
from agent.surfaces.statusview import ActionLog

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class MemoryIntegration:
    def __init__(
        self,
        settings: EnforcementSettings,
        *,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        host: HostIntegration,
        kube: KubeIntegration,
        actions: ActionLog,
        procfs: ProcFS,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self._backend = backend
        self._gpus = tuple(gpus)
        self._host = host
        self._kube = kube
        self._actions = actions
        self._procfs = procfs
        self._clock = clock or SystemClock()
        mode = settings.memory_mode if settings.enabled else MemoryQuotaMode.AUDIT
        deny = None
        if mode is MemoryQuotaMode.DENY:
            program = MemoryDenyProgram(source_path=host.bpf_settings.bpf_dir / "memquota_lsm.c")
            deny = open_deny_program(program, probe_bpf_lsm())
            if deny is None:
                mode = MemoryQuotaMode.KILL
        self.mode = str(mode)
        self.guard = MemoryGuard(mode=mode, procfs=procfs, clock=self._clock, events=kube.events, deny=deny)
        self.limits = DriverMemoryLimits(backend, self._cgroup_v2, unavailable=self._limits_unavailable(mode))
        self._times = AllocationTimes()
        self.cadence = CheckCadence(
            CadenceSettings(base_s=settings.memory_check_s, near_s=settings.memory_check_near_s)
        )
        self._next_check_s = settings.memory_check_s
        self._idle_read_at = -float("inf")  # GPUs nobody checked uses were last read then
        self._lock = threading.Lock()
        self._by_container: dict[str, int] = {}  # label -> MiB
        self._by_gpu: dict[int, int] = {}
        self._reported: set[str] = set()
        self.read_errors = 0  # failed per-process memory reads (metrics: vcuda_nvml_errors_total)
        # The inputs of the last full check when it found nobody over or near a quota, and
        # its use per container: a full check that reads the same again judges nothing anew.
        self._quiet_inputs: _Inputs | None = None
        self._quiet_usage: dict[str, Usage] = {}
        self.repeats = 0  # full checks that read what the last one judged (status, tests)

    def run(self, stop: threading.Event) -> None:
        base = self.settings.memory_check_s
        delay, next_full = base, self._clock.monotonic() + base
        while not self._clock.sleep(delay, stop):
            started = self._clock.monotonic()
            fast = self.cadence.fast()
            if started >= next_full - 1e-3 or not fast:
                next_full = started + base
                self.check_once()
            else:
                # Between full checks, only the containers near their quota: a short-period
                # check of every container cost 14 points of a core at 40 containers.
                self.check_once(only=set(fast))
            # The period is from check to check: a slow check does not stretch it.
            delay = max(0.0, min(started + self._next_check_s, next_full) - self._clock.monotonic())

    def _limits_unavailable(self, mode: MemoryQuotaMode) -> str | None:
        if mode is MemoryQuotaMode.AUDIT:
            return "memory quota mode is audit"
        if self._host.facts.layout.v2_root is None:
            return "driver memory limits need cgroup v2"
        return self._backend.memory_limits_support()

    def _cgroup_v2(self, spec: EnforcementSpec) -> Path | None:
        dirs = self._host.resolver.container_dirs(
            spec.pod_uid, spec.qos_class or None, spec.container_id, UNIFIED
        )
        return None if dirs is None else dirs.scope

    def check_once(self, only: set[str] | None = None) -> None:
        """Check every container, or (``only``) just those labels, on the GPUs they use."""
        all_specs = self._kube.specs()
        if only is None:
            self.limits.apply(all_specs)
        specs = {
            ContainerRef(s.pod_uid, s.container_id): s
            for s in all_specs
            if s.container_id and (only is None or s.label in only)
        }
        now = self._clock.monotonic()
        idle_due = only is None and now - self._idle_read_at >= self.settings.idle_read_s - 1e-3
        if idle_due:
            self._idle_read_at = now
        gpus = gpus_to_read(self._gpus, specs.values(), idle_due=idle_due)
        traced, times = self._traced() if specs else (None, None)  # nobody to judge: no read
        read: dict[int, list[ProcessMemory]] = {}
        for gpu in gpus:
            try:
                read[gpu.index] = self._backend.process_memory(gpu.index)
            except VcudaError as err:
                self.read_errors += 1
                self._report(f"cannot read GPU {gpu.index} process memory: {err}")
        inputs = None
        if only is None:
            inputs = _Inputs.of(specs.values(), read, traced, times, self._host.processes.identity)
            if inputs == self._quiet_inputs:
                # What was read is what the last full check judged, and nobody was over
                # then: the same judgement again. Only the cadence hears of it (its rates).
                self._next_check_s = self.cadence.after_check(now, self._quiet_usage)
                self.repeats += 1
                return
        views, by_gpu = self._views(specs, read, traced, times)
        usage = {v.key: sum(p.used_bytes for p in v.processes) // MIB for v in views}
        with self._lock:
            if only is None:
                attempted = {g.index for g in gpus}
                kept = {i: mib for i, mib in self._by_gpu.items() if i not in attempted}  # not due
                self._by_container, self._by_gpu = usage, {**kept, **by_gpu}
            else:
                self._by_container.update(usage)
                self._by_gpu.update(by_gpu)
        quotas = {
            v.key: Usage(sum(p.used_bytes for p in v.processes), v.quota_mib * MIB)
            for v in views
            if v.quota_mib is not None
        }
        now = self._clock.monotonic()
        self._next_check_s = self.cadence.after_check(now, quotas, partial=only is not None)
        actions = self.guard.check(views, partial=only is not None)
        for action in actions:
            detail = f"{format_mib(action.used_bytes)} used of a {format_mib(action.quota_bytes)} quota"
            self._actions.record(action.key, action.action, detail)
        quiet = only is None and not actions and not self.guard.over and not self.cadence.fast()
        self._quiet_inputs = inputs if quiet else None
        self._quiet_usage = quotas if quiet else {}

    def _views(
        self,
        specs: dict[ContainerRef, EnforcementSpec],
        read: dict[int, list[ProcessMemory]],
        traced: dict[int, int] | None,
        times: dict[int, int] | None,
    ) -> tuple[list[MemoryView], dict[int, int]]:
        """Each container's view (its processes' memory, what the tracer adds), and MiB per GPU."""
        by_gpu: dict[int, int] = {}
        grouped: dict[ContainerRef, list[ProcessMemory]] = {}
        for index, memory in read.items():
            by_gpu[index] = sum(m.used_bytes for m in memory) // MIB
            for m in memory:
                ref = self._owner(m.pid)
                if ref in specs:
                    grouped.setdefault(ref, []).append(m)
        # Allocations NVML does not show yet belong to their container too: one owner lookup
        # per traced pid, not one per pid and container.
        traced_by_ref: dict[ContainerRef, dict[int, int]] = {}
        for pid, held in (traced or {}).items():
            ref = self._owner(pid)
            if ref in specs:
                traced_by_ref.setdefault(ref, {})[pid] = held
        return [
            self._view(
                spec, grouped.get(ref, []), None if traced is None else traced_by_ref.get(ref, {}), times
            )
            for ref, spec in specs.items()
        ], by_gpu

    def _view(
        self,
        spec: EnforcementSpec,
        memory: list[ProcessMemory],
        traced: dict[int, int] | None,
        times: dict[int, int] | None,
    ) -> MemoryView:
        """``traced``: this container's pids → video memory the tracer saw (None: no tracer)."""
        uses = process_uses(memory, self, traced, times)
        return MemoryView(spec.label, self._kube.pods.get(spec.pod_uid), spec.memory_quota_mib, uses)

    def _traced(self) -> tuple[dict[int, int] | None, dict[int, int] | None]:
        """pid -> video-memory bytes held, and pid -> last allocation time, from the tracer."""
        tracer = self._host.tracer
        if tracer is None:
            return None, None
        try:
            snapshot = tracer.snapshot()
        except VcudaError as err:
            self._report(f"cannot read the ioctl tracer: {err}")
            return None, None
        held: dict[int, int] = {}
        allocated: dict[int, int] = {}
        for stats in snapshot.processes.values():
            held[stats.pid] = held.get(stats.pid, 0) + max(0, stats.vidmem_bytes)
            allocated[stats.pid] = allocated.get(stats.pid, 0) + stats.vidmem_bytes_allocated
        return held, self._times.observe(allocated, time.time_ns())

    def identity(self, pid: int) -> ProcessIdentity:
        """From the process cache (kept current by exit events) when it knows the pid, else
        /proc: a memory check judges every GPU process several times a second, and reading
        each one's /proc/<pid>/stat each time was most of the agent's CPU on a full node.
        A kill checks the identity against /proc again before it acts."""
        cached = self._host.processes.identity(pid)
        return cached if cached is not None else self._procfs.identity(pid)

    def _owner(self, pid: int) -> ContainerRef | None:
        try:
            return self._host.processes.get(pid)
        except VcudaError:
            return None

    def _report(self, message: str) -> None:
        if message not in self._reported:
            self._reported.add(message)
            log.warning("%s", message)

    # Reading ----------------------------------------------------------------------------------
    def usage_by_container(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_container)

    def gpu_used_mib(self, index: int) -> int | None:
        with self._lock:
            return self._by_gpu.get(index)


@dataclass(frozen=True)
class _Inputs:
    """Everything a full check judges from: the containers and their quotas, what NVML read
    per GPU, and the tracer's bytes and allocation times. Equal inputs, equal verdicts."""

    specs: tuple[tuple[str, str, int | None], ...]
    memory: tuple[tuple[int, tuple[ProcessMemory, ...]], ...]
    processes: tuple[ProcessIdentity | None, ...]  # of the pids NVML listed: a reused pid differs
    traced: tuple[tuple[int, int], ...] | None
    times: tuple[tuple[int, int], ...] | None

    @classmethod
    def of(
        cls,
        specs: Iterable[EnforcementSpec],
        read: dict[int, list[ProcessMemory]],
        traced: dict[int, int] | None,
        times: dict[int, int] | None,
        identity: Callable[[int], ProcessIdentity | None],
    ) -> _Inputs:
        return cls(
            tuple((s.label, s.container_id, s.memory_quota_mib) for s in specs),
            tuple((index, tuple(memory)) for index, memory in read.items()),
            tuple(identity(m.pid) for memory in read.values() for m in memory),
            None if traced is None else tuple(traced.items()),
            None if times is None else tuple(times.items()),
        )


def gpus_to_read(
    gpus: Sequence[GpuInfo], specs: Iterable[EnforcementSpec], *, idle_due: bool
) -> tuple[GpuInfo, ...]:
    """The GPUs a memory check reads: those the checked containers use, and (``idle_due``,
    once an ``idle_read_s``) the others too, for their used-memory figure: nobody's quota is
    checked there. All of them where a container's GPUs are not known."""
    used: set[int] = set()
    for spec in specs:
        if not spec.gpus:
            return tuple(gpus)
        used.update(spec.gpus)
    return tuple(gpus) if idle_due else tuple(g for g in gpus if g.index in used)
