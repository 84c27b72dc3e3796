"""The node agent's enforcement side, built from the settings: the duty-cycle controller with
its actuator and freeze journal, the watchdog process, the GPU memory guard, and the
status endpoint that `vcuda-agent status` reads.

Start-up order matters for safety: anything a previous run left frozen is thawed first,
then the watchdog starts (so it exists before the first freeze), then the loops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.clock import Clock, SystemClock
from agent.control.actuators import ThrottleTarget, make_actuator
from agent.control.containers import ContainerControl
from agent.control.enforcer import Enforcer
from agent.control.mpssharing import GpuSharing, MpsSharing
from agent.control.supervisor import Supervisor
from agent.domain.dutycontrol import Gains
from agent.domain.health import HealthBoard
from agent.domain.specs import EnforcementSpec
from agent.domain.turns import TurnSettings
from agent.errors import VcudaError
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import QosClass, pod_relpath
from agent.platform.freezejournal import FreezeJournal, thaw_everything
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.procfs import ProcFS
from agent.platform.watchdog import WatchdogHandle, spawn_watchdog
from agent.settings import EnforcementSettings
from agent.surfaces.hostnode import HostIntegration
from agent.surfaces.kubenode import KubeIntegration
from agent.surfaces.memorynode import MemoryIntegration
from agent.surfaces.migstatus import MigStatus
from agent.surfaces.statusserver import StatusServer
from agent.surfaces.statusview import (
    ActionLog,
    ContainerStatus,
    GpuStatus,
    GuardExemption,
    MpsDaemonInfo,
    StatusDocument,
    agent_info,
    container_status,
    gpu_status,
    status_document,
)

log = logging.getLogger(__name__)

UNHOLDABLE_REASON = "GPUShareNotHoldable"
MIXED_USERS_REASON = "GPUMpsUsersMixed"


class EnforcementIntegration:
    def __init__(
        self,
        settings: EnforcementSettings,
        *,
        node_name: str,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        board: HealthBoard,
        host: HostIntegration,
        kube: KubeIntegration,
        sharing: MpsSharing | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.node_name = node_name
        self._backend = backend
        self._gpus = tuple(gpus)
        self._board = board
        self._host = host
        self._kube = kube
        self.sharing = sharing
        self.dra_state: Callable[[], str] = lambda: "off"  # the node agent sets it under --dra
        self.mig_state: Callable[[], Mapping[int, MigStatus]] = dict  # the node agent sets it
        # The node agent sets it: GPUs whose shares are MIG instances (mig.onDemand). The
        # hardware holds those shares; the controller leaves their containers alone.
        self.hardware_held: Callable[[], frozenset[int]] = frozenset
        # The node agent sets it: the NVIDIA_VISIBLE_DEVICES hole's (state, detail).
        self.visible_devices_hole: Callable[[], tuple[str, str]] = lambda: ("unknown", "not checked")
        self._clock = clock or SystemClock()
        self._started = self._clock.monotonic()
        procfs = ProcFS(host.cgroup_settings.proc_root)
        self.journal = FreezeJournal(settings.journal_path)
        self.actuator = make_actuator(settings.actuator, self.journal, procfs)
        self.actions = ActionLog()
        self.enforcer = Enforcer(
            gpus=[g.index for g in self._gpus],
            samples=backend,
            specs=self.controlled_specs,
            owner_of=host.processes.get,
            locate=self.locate,
            actuator=self.actuator,
            period_s=settings.period_s,
            gains=Gains(
                gain=settings.gain,
                min_duty=settings.min_duty,
                window_s=settings.window_s,
                period_s=settings.period_s,
                max_cycle_s=settings.max_cycle_s,
                idle_hold_s=settings.idle_hold_s,
            ),
            turns=TurnSettings(cycle_s=settings.cycle_s, max_wait_s=settings.max_wait_s),
            feedback=settings.feedback.value,
            concurrent=sharing.concurrent if sharing is not None else lambda _gpu: False,
            idle_read_s=settings.idle_read_s,
            untrusted=(lambda s: sharing.blind_share(s.pod_uid, s.container)) if sharing else lambda _s: None,
            clock=self._clock,
            enabled=settings.enabled,
        )
        self.enforcer.on_action.append(self.actions.record)
        self.enforcer.on_unholdable.append(self._unholdable_event)
        self._procfs = procfs
        if sharing is not None:
            sharing.users_of = self._container_users
            sharing.uids_of = self._container_uids
            sharing.cgroup_of = self._container_cgroup
            sharing.on_mixed_users = self._mixed_users_event
        self.memory = MemoryIntegration(
            settings,
            backend=backend,
            gpus=self._gpus,
            host=host,
            kube=kube,
            actions=self.actions,
            procfs=procfs,
        )
        self.watchdog: WatchdogHandle | None = None
        self.status_server = StatusServer(settings.status_socket, self.status)

    def _unholdable_event(self, spec: EnforcementSpec, why: str) -> None:
        """A Warning Event on the pod whose cap the freezer cannot hold (it queues; never blocks)."""
        pod = self._kube.pods.get(spec.pod_uid)
        if pod is not None:
            self._kube.events.pod(pod, UNHOLDABLE_REASON, f"container {spec.container}: {why}")

    def _container_users(self, pod_uid: str, container: str) -> frozenset[int]:
        """The real user ids the container's processes run as (none known: empty)."""
        return self._container_uids(pod_uid, container, every=False)

    def _container_uids(self, pod_uid: str, container: str, every: bool = True) -> frozenset[int]:
        """The user ids of the container's processes: each one's real, effective, saved and
        filesystem uid (``every``; any of them it may switch to), else its real uid."""
        spec = next((s for s in self._kube.specs() if (s.pod_uid, s.container) == (pod_uid, container)), None)
        target = self.locate(spec) if spec is not None else None
        if target is None or target.procs_file is None:
            return frozenset()
        try:
            pids = [int(p) for p in target.procs_file.read_text().split()]
        except (OSError, ValueError):
            return frozenset()
        uids: set[int] = set()
        for pid in pids:
            try:
                uids.update(self._procfs.uids(pid) if every else (self._procfs.real_uid(pid),))
            except VcudaError:
                continue  # gone meanwhile
        return frozenset(uids)

    def _container_cgroup(self, pod_uid: str, container: str) -> Path | None:
        """The v2 cgroup an MPS v3 namespace is bound to: the container's once it exists;
        before (at Allocate), the pod's, where the kubelet will make it, so that a client
        that initialises CUDA at once is covered (None: neither known, or no v2 hierarchy)."""
        root = self._host.facts.layout.v2_root
        if root is None:
            return None
        spec = next((s for s in self._kube.specs() if (s.pod_uid, s.container) == (pod_uid, container)), None)
        if spec is not None and spec.container_id:
            dirs = self._host.resolver.container_dirs(spec.pod_uid, spec.qos_class or None, spec.container_id)
            if dirs is not None:
                return dirs.scope
        pod = self._kube.pods.get(pod_uid)
        qos = spec.qos_class if spec is not None else (pod.qos_class if pod is not None else "")
        try:
            return root / pod_relpath(self._host.resolver.driver, pod_uid, QosClass(qos))
        except ValueError:
            return None  # QoS class not known yet

    def _mixed_users_event(self, gpu: int, keys: list[str], uids: list[int]) -> None:
        """A Warning Event on each pod of the GPU's MPS clients: a client of another uid waits."""
        why = (
            f"GPU {gpu}: the MPS clients run as user ids {', '.join(map(str, uids))}; MPS serves one "
            "uid at a time, so a client of another uid waits until the running one's clients are done "
            "(run them as one user, or put them on another GPU)"
        )
        log.warning("%s", why)
        for key in keys:
            pod = self._kube.pods.get(key.partition("/")[0])
            if pod is not None:
                self._kube.events.pod(pod, MIXED_USERS_REASON, why)

    def controlled_specs(self) -> list[EnforcementSpec]:
        """The specs the compute-cap loop holds: all but those on GPUs that serve shares as
        MIG instances (no software limit is needed there, and NVML has no utilization of a
        GPU in MIG mode to hold them with)."""
        held = self.hardware_held()
        return [s for s in self._kube.specs() if not (s.gpus and held.intersection(s.gpus))]

    def locate(self, spec: EnforcementSpec) -> ThrottleTarget | None:
        """The container's freezer directory: its v2 scope when there is a v2 hierarchy (the
        v2 freezer works on hybrid nodes too), else its dir in the v1 freezer hierarchy."""
        layout = self._host.facts.layout
        controllers = [UNIFIED] if layout.v2_root is not None else []
        if "freezer" in layout.v1_roots:
            controllers.append("freezer")
        resolver = self._host.resolver
        for controller in controllers:
            dirs = resolver.container_dirs(
                spec.pod_uid, spec.qos_class or None, spec.container_id, controller
            )
            if dirs is not None:
                return ThrottleTarget(spec.label, dirs.scope, dirs.leaf / "cgroup.procs")
        return None

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, supervisor: Supervisor) -> None:
        report = thaw_everything(self.settings.journal_path)
        if report.found:
            log.warning("start-up: %s (left by a previous run)", report.summary())
        if self.settings.enabled and self.settings.watchdog:
            try:
                self.watchdog = spawn_watchdog(self.settings.journal_path)
            except VcudaError as err:
                log.error("no watchdog: %s; containers frozen at a crash stay frozen until restart", err)
        log.info(
            "enforcement %s: period %.2f s, window %.1f s, actuator %s, memory quotas: %s",
            "on" if self.settings.enabled else "off (measuring only)",
            self.settings.period_s,
            self.settings.window_s,
            self.settings.actuator,
            self.settings.memory_mode,
        )
        supervisor.spawn("enforcer", self.enforcer.run)
        supervisor.spawn("memory-guard", self.memory.run)
        try:
            self.status_server.start()
        except VcudaError as err:
            log.error("no status endpoint: %s", err)

    def stop(self) -> None:
        """After the supervisor stopped the loops (the enforcer thawed on its way out)."""
        self.status_server.stop()
        self.enforcer.release_all()
        if self.watchdog is not None:
            self.watchdog.close()

    # Status ---------------------------------------------------------------------------------
    def watchdog_state(self) -> str:
        if self.watchdog is None:
            return "off"
        return "running" if self.watchdog.alive() else "dead"

    def status(self) -> StatusDocument:
        controls = self.enforcer.controls()
        views = self.enforcer.gpu_views()
        memory = self.memory.usage_by_container()
        sharing = {g.gpu: g for g in self.sharing.gpus()} if self.sharing is not None else {}
        mig = self.mig_state()
        gpus: list[GpuStatus] = []
        for gpu in self._gpus:
            rows = [
                self._container_row(c, memory)
                for c in controls
                if c.spec.gpus and c.spec.gpus[0] == gpu.index
            ]
            used_mib = self.memory.gpu_used_mib(gpu.index)
            view = views.get(gpu.index)
            gpus.append(
                gpu_status(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    model=gpu.model,
                    healthy=self._board.is_healthy(gpu.index),
                    memory_total_mib=gpu.memory_mib,
                    cores_allocated=self._kube.ledger.usage(gpu.index).cores,
                    utilization_percent=view.device_percent if view else None,
                    memory_used_mib=used_mib,
                    containers=rows,
                    degraded=view.stale if view else None,
                    mig=mig.get(gpu.index),
                    **_sharing_fields(sharing.get(gpu.index)),
                )
            )
        agent = agent_info(
            pid=os.getpid(),
            uptime_s=self._clock.monotonic() - self._started,
            backend=self._backend.name,
            enforcing=self.settings.enabled,
            actuator=self.actuator.name,
            memory_mode=self.memory.mode,
            period_s=self.settings.period_s,
            watchdog=self.watchdog_state(),
            bpf=self._host.bpf_status(),
            freeze_journal=self.journal.write_error or "ok",
            dra=self.dra_state(),
            visible_devices_hole=self.visible_devices_hole(),
        )
        return status_document(
            node=self.node_name,
            time=self._clock.wall(),
            agent=agent,
            gpus=gpus,
            recent_actions=self.actions.snapshot(),
            guard_exemptions=[
                GuardExemption(namespace=e.namespace, pod=e.pod, reason=e.reason)
                for e in self._host.guard_exemptions()
            ],
        )

    def _container_row(self, control: ContainerControl, memory: dict[str, int]) -> ContainerStatus:
        spec = control.spec
        return container_status(
            namespace=spec.namespace,
            pod=spec.pod,
            container=spec.container,
            policy=spec.policy,
            request_cores=spec.cores,
            whole=spec.whole,
            cap_percent=spec.cap,
            ceiling_percent=spec.ceiling,
            used_percent=control.used if self.enforcer.measured(control) else None,
            target_percent=control.goal,
            duty=control.state.duty,
            cycle_s=control.cycle_s if control.throttled else None,
            drain_s=control.state.drain_s,
            frozen=control.frozen,
            memory_used_mib=memory.get(spec.label),
            memory_quota_mib=spec.memory_quota_mib,
            throttled=control.throttled,
            compute_held_by=self.compute_holder(control),
            memory_held_by=self.memory_holder(spec),
            problem=control.problem,
            unholdable=control.unholdable,
        )

    def compute_holder(self, control: ContainerControl) -> tuple[str, str]:
        """What holds the container's compute share, and how or why."""
        spec = control.spec
        if spec.whole:
            return "none", "a whole GPU is never limited"
        grant = self.sharing.grant(spec.pod_uid, spec.container) if self.sharing is not None else None
        untrusted = self.sharing.untrusted(spec.pod_uid, spec.container) if self.sharing is not None else None
        if grant is not None and untrusted is not None:
            return "freezer", f"{grant.describe()}: {untrusted}"
        if grant is not None:
            if not self.enforcer.measured(control):
                # NVIDIA: NVML credits MPS clients' work to the MPS server.
                return "mps+freezer", f"{grant.describe()}; no per-client samples (NVML credits the server)"
            return "mps+freezer", grant.describe()
        if spec.ceiling is None:
            return "none", f"{spec.policy} is never throttled"
        refused = self.sharing.refused(spec.pod_uid, spec.container) if self.sharing is not None else None
        why = self.sharing.why_not(spec.gpus[0]) if self.sharing is not None and spec.gpus else None
        return "freezer", refused or why or "started before its GPU's MPS daemon was up"

    def memory_holder(self, spec: EnforcementSpec) -> tuple[str, str]:
        """What holds the container's GPU memory quota, and how or why."""
        if spec.whole or spec.memory_quota_mib is None:
            return "none", "no quota"
        grant = self.sharing.grant(spec.pod_uid, spec.container) if self.sharing is not None else None
        driver, detail = self.memory.limits.holder(spec.label)
        if driver:
            return "driver", detail
        trusted = self.sharing is not None and self.sharing.untrusted(spec.pod_uid, spec.container) is None
        if grant is not None and grant.memory_mib and trusted:
            return "mps", f"pinned device memory limit {grant.memory_mib} MiB"
        return self.memory.mode, f"no driver limit: {detail}"


def _sharing_fields(sharing: GpuSharing | None) -> dict[str, Any]:
    if sharing is None:
        return {}
    daemon = sharing.daemon
    info: MpsDaemonInfo | None = None
    if daemon is not None:
        info = MpsDaemonInfo(
            state=str(daemon.state), pid=daemon.pid, restarts=daemon.restarts, error=daemon.error
        )
    return {"sharing": (sharing.actuator, sharing.reason), "mps_daemon": info}
