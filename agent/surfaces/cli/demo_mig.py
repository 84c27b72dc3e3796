"""The demo's MIG story, inside the live act: GPU 3 of the simulated node is an H100-80GB in
MIG mode with a 3g.40gb and a 2g.20gb instance (``sim-gpu --mig``), and the agent runs with
the node config's MIG strategy ``mixed``, so it serves ``nvidia.com/mig-3g.40gb`` and
``nvidia.com/mig-2g.20gb`` as device plugins of their own and GPU 3 offers no shares.

Two pods each get one instance through kubelet's Allocate: ``mig-2g-steady`` runs a training
loop on its 2g from the start; ``mig-3g-deep`` arrives later and keeps its queue full of
50 ms kernels (over 50 s of queued work) on the 3g. The table's MIG rows show each
instance's activity as the simulated GPU reports it per GPU instance (GPM's SM utilization)
and its throughput in shares of the whole GPU (the GPU's exact accounting), and the line
under it compares the 2g's throughput before and after its neighbour came: the same, at
most its 32 of 132 SMs, as hardware isolation makes it (docs/mig.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from agent.emulators.cluster import container_id
from agent.emulators.containers import RunningContainer
from agent.emulators.enforcednode import PERMISSIVE_NODE, EnforcedNode, wait_for
from agent.emulators.pods import ContainerRequest, PodSpec
from agent.errors import VcudaError
from agent.platform.cgroups.paths import QosClass
from agent.platform.gpu.sim.client import NodeClient
from agent.platform.gpu.sim.migclient import GpmSample, SimNvml, gpm_sm_util
from agent.platform.gpu.sim.nodefile import SimNodeDir

SPEC = "4xH100-80GB"  # GPUs 0-1: device plugin shares, 2: DRA, 3: MIG
MIG_GPU = 3
GPU_ARGS = ("--mig", f"{MIG_GPU}:3g.40gb,2g.20gb")
H100_SMS = 132
DEEP_AT_S = 8.0  # when the deep-queue tenant arrives (after at least MIN_ALONE_S of the 2g alone)
MIN_ALONE_S = 2.0


@dataclass(frozen=True)
class MigPlan:
    name: str
    profile: str
    workload: tuple[str, ...]  # sim-workload options

    @property
    def resource(self) -> str:
        return f"nvidia.com/mig-{self.profile}"


# A training loop: steps of 20 kernels of 10 ms (whole-GPU time), a sync after each.
STEADY = MigPlan("mig-2g-steady", "2g.20gb", ("--pattern", "train", "--kernel-ms", "10"))
# Deep work: its queue kept full (1024 launches) of 50 ms kernels.
DEEP = MigPlan("mig-3g-deep", "3g.40gb", ("--pattern", "burn", "--kernel-ms", "50"))


@dataclass
class MigPod:
    plan: MigPlan
    box: RunningContainer
    uuid: str  # the MIG device Allocate handed out
    gi: int
    placement: str
    sm_count: int


def mig_agent_args(workdir: Path) -> tuple[str, ...]:
    """The node config with strategy ``mixed`` (it replaces the enforced node's own)."""
    path = workdir / "node-config-mig.json"
    path.write_text(json.dumps({"nodeConfig": [{**PERMISSIVE_NODE, "mig": {"strategy": "mixed"}}]}))
    return ("--config", str(path))


def start_mig_pod(node: EnforcedNode, plan: MigPlan) -> MigPod:
    """Create the pod, admit it through the profile's device plugin (Allocate over real gRPC),
    and start its workload on the MIG device it was given; returns once it runs there."""
    node.kubelet.wait_for_plugin(plan.resource, timeout_s=30)
    limits = {plan.resource: "1"}
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": plan.name, "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "cuda", "resources": {"limits": limits}}]},
    }
    created = node.node.create_pod(manifest)
    spec = PodSpec(created.name, created.namespace, created.uid, (ContainerRequest("c", 1),))
    admission = node.kubelet.admit(spec, plan.resource)
    node.node.mark_running(spec)
    envs = dict(admission.containers[0].response.envs)
    uuid = envs["VCUDA_MIG_DEVICES"]
    pod = node.api.pod("default", plan.name) or {}
    # The container toolkit makes NVIDIA_VISIBLE_DEVICES the only device CUDA sees.
    visible = {"CUDA_VISIBLE_DEVICES": envs.get("NVIDIA_VISIBLE_DEVICES", uuid)}
    box = node.runtime.start(
        f"default/{plan.name}/c",
        pod_uid=spec.uid,
        qos=QosClass(pod.get("status", {}).get("qosClass", "BestEffort")),
        container_id=container_id(spec.uid, "c"),
        gpu=MIG_GPU,
        extra=plan.workload,
        envs={**envs, **visible},
    )
    meter = MigMeter(node)
    try:
        wait_for(lambda: meter.running(uuid) or box.proc.poll() is not None, 30, f"{plan.name} on {uuid}")
        device = meter.device(uuid)
    finally:
        meter.close()
    if box.proc.poll() is not None:
        code = box.proc.returncode
        raise VcudaError(f"the workload of {plan.name} exited with {code} before reaching its MIG device")
    return MigPod(plan, box, uuid, int(device["gi"]), str(device["placement"]), int(device["sm_count"]))


class MigMeter:
    """The simulated GPU's own accounting of its MIG devices: exact work per device
    (``mig_truth``) and GPM-like SM-busy samples per GPU instance."""

    def __init__(self, node: EnforcedNode) -> None:
        socket = SimNodeDir(node.runtime.sim_state_dir).socket
        self._client = NodeClient(socket)
        self._nvml = SimNvml(socket)

    def close(self) -> None:
        self._client.close()
        self._nvml.close()

    def truth(self) -> dict[str, Any]:
        return self._client.mig_truth()

    def running(self, uuid: str) -> bool:
        return any(d["uuid"] == uuid and d["contexts"] for d in self.truth()["devices"])

    def device(self, uuid: str) -> dict[str, Any]:
        state = self._client.mig_state()
        found = [d for g in state for d in g["devices"] if d["uuid"] == uuid]
        if not found:
            raise VcudaError(f"no MIG device {uuid} on the simulated GPU")
        placement = f"{found[0]['placement_start']}:{found[0]['placement_size']}"
        return {**found[0], "placement": placement}

    def gpm(self, gi: int) -> GpmSample:
        return self._nvml.nvmlGpmMigSampleGet(MIG_GPU, gi)


@dataclass
class Reading:
    monotonic: float  # the GPU server's clock
    work_s: float  # whole-GPU seconds of work the device has done
    queued: int
    gpm: GpmSample


@dataclass
class MigRow:
    pod: MigPod
    last: Reading | None = None
    sm_util: float | None = None  # GPM SM utilization of its instance since the last refresh, %
    throughput: float | None = None  # percent of the whole GPU's work since the last refresh
    queued: int = 0


@dataclass
class MigStory:
    """The MIG rows and the 2g's throughput before and after its deep-queue neighbour."""

    rows: list[MigRow] = field(default_factory=list)
    alone: tuple[Reading, Reading] | None = None  # the 2g's first reading and at the neighbour's arrival
    beside: Reading | None = None  # the 2g's reading once the neighbour runs

    def add(self, pod: MigPod, meter: MigMeter) -> None:
        row = MigRow(pod)
        row.last = read(meter, pod)
        self.rows.append(row)

    def refresh(self, meter: MigMeter) -> None:
        for row in self.rows:
            now = read(meter, row.pod)
            if row.last is not None and now.monotonic > row.last.monotonic:
                span = now.monotonic - row.last.monotonic
                row.throughput = 100 * (now.work_s - row.last.work_s) / span
                if now.gpm.timestamp > row.last.gpm.timestamp:
                    row.sm_util = gpm_sm_util(row.last.gpm, now.gpm)
            row.queued = now.queued
            row.last = now

    def steady(self) -> MigRow | None:
        return next((r for r in self.rows if r.pod.plan is STEADY), None)

    def mark_alone(self, meter: MigMeter, first: Reading) -> None:
        steady = self.steady()
        if steady is not None:
            self.alone = (first, read(meter, steady.pod))

    def mark_beside(self, meter: MigMeter) -> None:
        steady = self.steady()
        if steady is not None:
            self.beside = read(meter, steady.pod)

    def comparison(self, meter: MigMeter) -> str:
        """``2g.20gb throughput: 24.2 % of the GPU alone, 24.2 % beside ...``"""
        steady = self.steady()
        if steady is None or self.alone is None:
            return ""
        alone = rate(*self.alone)
        limit = 100 * steady.pod.sm_count / H100_SMS
        text = f"MIG: {STEADY.profile} throughput {alone:.1f} % of the GPU alone"
        if self.beside is not None:
            now = read(meter, steady.pod)
            if now.monotonic > self.beside.monotonic:
                text += f", {rate(self.beside, now):.1f} % beside the deep-queue {DEEP.profile}"
        return text + f" (its {steady.pod.sm_count} of {H100_SMS} SMs: at most {limit:.1f} %)"


def read(meter: MigMeter, pod: MigPod) -> Reading:
    truth = meter.truth()
    devices = [d for d in truth["devices"] if d["uuid"] == pod.uuid]
    work = float(devices[0]["work_s"]) if devices else 0.0
    queued = sum(int(c["queued"]) for d in devices for c in d["contexts"])
    return Reading(float(truth["monotonic"]), work, queued, meter.gpm(pod.gi))


def rate(first: Reading, second: Reading) -> float:
    """Percent of the whole GPU's work done between two readings."""
    span = second.monotonic - first.monotonic
    return 100 * (second.work_s - first.work_s) / span if span > 0 else 0.0


def mig_table(rows: Sequence[MigRow], status: Mapping[str, Any]) -> Table:
    """The MIG rows: instance, profile, pod, activity, throughput, and the agent's view."""
    agent = _agent_devices(status)
    table = Table(
        title=f"GPU {MIG_GPU} in MIG mode (strategy mixed): one pod per instance",
        title_justify="left",
        expand=False,
        pad_edge=False,
    )
    for name, justify in (
        ("POD", "left"),
        ("PROFILE", "left"),
        ("INSTANCE", "left"),
        ("SMs", "right"),
        ("SM UTIL (GPM)", "right"),
        ("THROUGHPUT of GPU", "right"),
        ("QUEUED", "right"),
        ("HEALTH (agent)", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        pod = row.pod
        table.add_row(
            pod.plan.name,
            pod.plan.profile,
            f"GI {pod.gi} at {pod.placement}",
            str(pod.sm_count),
            "-" if row.sm_util is None else f"{row.sm_util:.0f}%",
            "-" if row.throughput is None else f"{row.throughput:.1f}%",
            str(row.queued),
            agent.get(pod.uuid, "-"),
        )
    return table


def _agent_devices(status: Mapping[str, Any]) -> dict[str, str]:
    """Each MIG device's health as the agent's status reports it, by UUID."""
    found: dict[str, str] = {}
    for gpu in status.get("gpus") or []:
        for device in (gpu.get("mig") or {}).get("devices") or []:
            found[str(device.get("uuid"))] = str(device.get("health", "-"))
    return found
