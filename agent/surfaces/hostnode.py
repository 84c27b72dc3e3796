"""The node agent's host side, built from the settings: what the host runs (cgroup
version and driver, container runtime), the cgroup resolver, the NVIDIA ioctl tracer
(with a clear fallback to NVML alone), the process cache fed by cn_proc, and the
device guard."""

from __future__ import annotations

import logging
import threading
from typing import Any

from agent.clock import SystemClock
from agent.control.deviceguard import DeviceGuard, default_rules
from agent.control.guardtargets import Exemption, GuardTargets
from agent.control.podgate import PodGate, gate_rules
from agent.control.supervisor import Supervisor
from agent.domain.nodeconfig import NodeConfig
from agent.errors import VcudaError
from agent.platform.bpf.ioctl_tracer import KPROBE_FUNCTIONS, IoctlTracer
from agent.platform.bpf.probe import BpfSupport, probe_bpf
from agent.platform.cgroups.detect import RuntimeFacts, detect_runtime_facts
from agent.platform.cgroups.paths import CgroupResolver, ContainerRef
from agent.platform.procevents import ProcessCache, ProcessChange
from agent.platform.procfs import ProcFS
from agent.settings import BpfSettings, CgroupSettings, GuardMode

log = logging.getLogger(__name__)

FORGET_EVERY_S = 5.0  # exited processes leave the tracer's maps this often


class HostIntegration:
    def __init__(self, cgroups: CgroupSettings, bpf: BpfSettings, node: NodeConfig) -> None:
        self.cgroup_settings = cgroups
        self.bpf_settings = bpf
        self.facts: RuntimeFacts = detect_runtime_facts(
            cgroup_root=cgroups.root,
            mountinfo=cgroups.mountinfo,
            kubelet_config=cgroups.kubelet_config,
            host_root=cgroups.host_root,
            driver_override=node.cgroup_driver,
            runtime_override=node.container_runtime_endpoint,
        )
        self.resolver = CgroupResolver(self.facts.layout, self.facts.driver, proc_root=cgroups.proc_root)
        self.processes: ProcessCache[ContainerRef] = ProcessCache(
            self.resolver.container_of_pid,
            procfs=ProcFS(cgroups.proc_root),
            rescan_interval_s=bpf.procevents_rescan_s,
            fallback_interval_s=bpf.procevents_fallback_s,
        )
        self.tracer: IoctlTracer | None = None
        self.bpf: BpfSupport | None = None
        self.guard: DeviceGuard | None = None
        self.gate: PodGate | None = None
        self._guard_targets: GuardTargets | None = None
        self._exited: list[int] = []
        self._exited_lock = threading.Lock()

    def enable_guard(self, targets: GuardTargets) -> None:
        """The device guard needs to know the pods (Kubernetes mode)."""
        mode = self.cgroup_settings.device_guard
        if mode is GuardMode.OFF:
            log.info("device guard: off")
            return
        self._guard_targets = targets
        rules = default_rules(self.facts.layout, self.bpf_settings.bpf_dir)
        self.guard = DeviceGuard(
            targets,
            self.resolver,
            rules,
            mode=mode,
            interval_s=self.cgroup_settings.guard_interval_s,
            proc_root=self.cgroup_settings.proc_root,
        )
        self.gate = PodGate(
            targets.pod_policy,
            self.resolver,
            gate_rules(rules),
            mode=mode,
            interval_s=self.cgroup_settings.gate_recheck_s,
            proc_root=self.cgroup_settings.proc_root,
            settled=targets.settled,
        )

    def start(self, supervisor: Supervisor) -> None:
        for line in self.facts.describe():
            log.info("host: %s", line)
        supervisor.spawn("process-events", self.processes.run)
        self.processes.subscribe(self._on_process)
        # Compiling the tracer takes a second or more: kubelet must not wait for it.
        supervisor.spawn("ioctl-tracer", self._run_tracer)
        if self.guard is not None:
            log.info("device guard: %s with %s", self.cgroup_settings.device_guard, self.guard.mechanism)
            supervisor.spawn("device-guard", self.guard.run)
        if self.gate is not None:
            supervisor.spawn("device-gate", self.gate.run)

    def _start_tracer(self) -> None:
        if not self.bpf_settings.ioctl_tracing:
            log.info("ioctl tracing off (--no-ioctl-tracing): running on NVML alone")
            return
        support = probe_bpf()
        if support.usable:
            tracer = IoctlTracer(
                mode=support.attach_mode,
                kprobe_function=support.kprobe_function or KPROBE_FUNCTIONS[0],
                source_path=self.bpf_settings.bpf_dir / "ioctl_tracer.c",
            )
            try:
                tracer.start()
            except VcudaError as err:
                support = support.load_failed(err)
            else:
                self.tracer = tracer
        self.bpf = support
        if self.tracer is None:
            log.warning("running on NVML alone: %s", support.reason)

    def _on_process(self, change: ProcessChange[ContainerRef]) -> None:
        if not change.started and self.tracer is not None:
            with self._exited_lock:
                self._exited.append(change.identity.pid)

    def _run_tracer(self, stop: threading.Event) -> None:
        """Start the tracer once, then drop exited processes from its maps until stopped."""
        if self.bpf is None:
            self._start_tracer()
        clock = SystemClock()
        while not clock.sleep(FORGET_EVERY_S, stop):
            with self._exited_lock:
                exited, self._exited = self._exited, []
            if exited and self.tracer is not None:
                self.tracer.forget(*exited)

    def guard_exemptions(self) -> list[Exemption]:
        """The pods the device guard leaves alone, and why (empty when the guard is off)."""
        return [] if self._guard_targets is None else self._guard_targets.exemptions()

    def bpf_status(self) -> str:
        """``off`` when tracing is switched off, ``starting`` while it compiles, else the probe's
        status (``ok``, ``no-headers``, ``load-failed``...)."""
        if not self.bpf_settings.ioctl_tracing:
            return "off"
        return self.bpf.status.value if self.bpf is not None else "starting"

    def status(self) -> dict[str, Any]:
        """For `vcuda-agent status` and the logs: what was detected and what runs."""
        return {
            "runtime": self.facts.as_dict(),
            "bpf": {"status": self.bpf_status(), "reason": self.bpf.reason if self.bpf else ""},
            "deviceGuard": self.cgroup_settings.device_guard.value if self.guard else "off",
            "processEvents": self.processes.mode,
        }

    def stop(self) -> None:
        if self.tracer is not None:
            self.tracer.stop()
            self.tracer = None
