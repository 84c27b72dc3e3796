"""A small node with every case the collectors branch on, for the exposition golden test:
fractional, burst and best-effort containers, a whole two-GPU container, one not started yet,
controls without a goal or a memory reading, a GPU without a utilization or memory reading,
several XIDs, tracer processes in unknown cgroups and with an unknown escape."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from agent.control.containers import DURATION_BUCKETS_S, ContainerControl, EnforcerStats, GpuView
from agent.control.deviceguard import GuardStats
from agent.control.podgate import GateStats
from agent.domain.annotations import Policy
from agent.domain.dutycontrol import DutyState
from agent.domain.health import XidCounts
from agent.domain.ledger import GpuUsage
from agent.domain.specs import EnforcementSpec
from agent.platform.bpf.ioctl_stats import IoctlSnapshot, ProcessIoctlStats, ProcessKey
from agent.platform.bpf.nvioctl import ESC_RM_ALLOC, ESC_RM_CONTROL, ESC_RM_FREE
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import GpuInfo
from agent.settings import GuardMode
from agent.surfaces.metrics.enforcement_collector import EnforcementCollector
from agent.surfaces.metrics.host_collector import HostCollector
from agent.surfaces.metrics.kube_collector import AllocationCollector
from agent.surfaces.metrics.legacy_collector import LegacyCollector
from agent.surfaces.metrics.tracer_collector import TracerCollector
from agent.surfaces.metrics.xid_collector import XidCollector

NODE = "golden-node"
GPUS = [
    GpuInfo(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559, 0, "0000:00:00.0", 0),
    GpuInfo(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559, 1, "0000:01:00.0", 0),
    GpuInfo(2, "GPU-cccc", "NVIDIA A100-SXM4-40GB", 40960, 2, "0000:02:00.0", 0),
]


def _spec(
    pod: str,
    gpus: tuple[int, ...],
    cores: int,
    *,
    policy: Policy = Policy.FIXED_SHARE,
    started: bool = True,
    namespace: str = "team-a",
) -> EnforcementSpec:
    whole = cores >= 100
    return EnforcementSpec(
        pod_uid=f"uid-{pod}",
        namespace=namespace,
        pod=pod,
        container="worker",
        container_id=f"cid-{pod}" if started else "",
        runtime="containerd" if started else "",
        qos_class="Burstable",
        gpus=gpus,
        cores=cores,
        cap=None if whole else cores,
        memory_quota_mib=None if whole else 1024 * cores // 10,
        policy=policy,
    )


SPECS = [
    _spec("fixed-a", (0,), 30),
    _spec("fixed-b", (0,), 25, namespace="team-b"),
    _spec("burst", (1,), 50, policy=Policy.BURST_SHARE),
    _spec("best", (1,), 10, policy=Policy.BEST_EFFORT),
    _spec("whole", (1, 2), 200),
    _spec("pending", (2,), 40, started=False),
    _spec('odd"name\\x', (2,), 5),  # label values that need escaping
]


def _controls() -> list[ContainerControl]:
    values = [
        (27.5, 30.0, 0.61, 1.25, 3),
        (0.0, None, 1.0, 0.0, 0),
        (88.125, 50.0, 0.4, 1234567.5, 123456),
        (3.0, None, 1.0, 0.0, 0),
        (199.0, None, 1.0, 0.0, 0),
        (4.75, 5.0, 0.123456789, 0.001, 7),
    ]
    specs = [s for s in SPECS if s.container_id]
    controls = [
        ContainerControl(spec=s, key=s.label, state=DutyState(duty=d), used=u, goal=g, frozen_s=f, freezes=n)
        for s, (u, g, d, f, n) in zip(specs, values, strict=True)
    ]
    held = controls[2]  # a deep queue the freezer cannot hold
    held.throttled, held.cycle_s, held.unholdable = True, 0.5, "at least 8.0 s of GPU work runs on"
    return controls


def _tracer_snapshot() -> IoctlSnapshot:
    def proc(cgroup: int, pid: int, escapes: dict[int, int], allocated: int) -> ProcessIoctlStats:
        return ProcessIoctlStats(
            cgroup, pid, sum(escapes.values()), 0, escapes, (0,) * 32, 1, 0, allocated, 0, 1, 0
        )

    processes = [
        proc(10, 100, {ESC_RM_ALLOC: 5, ESC_RM_CONTROL: 900}, 1 << 30),
        proc(10, 101, {ESC_RM_ALLOC: 2, ESC_RM_FREE: 1}, 1 << 20),
        proc(11, 102, {ESC_RM_CONTROL: 12, 0x99: 4}, 0),  # an escape without a name
        proc(12, 103, {ESC_RM_ALLOC: 1}, 12345),
        proc(99, 104, {ESC_RM_ALLOC: 7}, 5),  # a cgroup of no known container
        proc(13, 105, {ESC_RM_ALLOC: 3}, 7 << 33),  # the container that has not started
    ]
    return IoctlSnapshot(processes={ProcessKey(p.cgroup_id, p.pid): p for p in processes})


def registry() -> CollectorRegistry:
    """Every collector but AgentCollector (it shows the agent's version) over the node."""
    usage = {
        0: GpuUsage(0, 55, 56320, 100, 81559, ()),
        1: GpuUsage(1, 100, 81559, 100, 81559, ()),
        2: GpuUsage(2, 45, 4096, 100, 40960, ()),
    }
    kube = SimpleNamespace(
        node_name=NODE,
        ledger=SimpleNamespace(usage=usage.__getitem__),
        allocations=SimpleNamespace(allocations=17, refusals=2),
        recovery=SimpleNamespace(corrections=1),
        specs=lambda: SPECS,
    )
    stats = GuardStats(GuardMode.ENFORCE, "cgroup v2 bpf", 6, 1, 2, 3, 10, {})
    gate = SimpleNamespace(stats=lambda: GateStats(gated=4, applied=5, errors=1))
    guard = SimpleNamespace(stats=lambda: stats)
    host: Any = SimpleNamespace(bpf_status=lambda: "ok", guard=guard, gate=gate)
    counts = [5, 9, 20, 20, 20, 21, 21, 21, 21, 21, 21, 21][: len(DURATION_BUCKETS_S)]
    loop = EnforcerStats(
        periods=22, overruns=1, measure_errors=2, actuator_errors=3, bucket_counts=counts, duration_sum_s=0.75
    )
    views = {0: GpuView(0, 97.5, "nvml"), 1: GpuView(1, None, "nvml")}  # GPU 2: no view
    controls = _controls()
    memory = {"team-a/fixed-a/worker": 3000, "team-a/burst/worker": 81000, "team-a/whole/worker": 0}
    used_mib = {0: 48000, 1: 0}
    enforcement: Any = SimpleNamespace(
        enforcer=SimpleNamespace(
            gpu_views=lambda: views, controls=lambda: controls, stats=loop, measured=lambda _c: True
        ),
        memory=SimpleNamespace(
            usage_by_container=lambda: memory,
            gpu_used_mib=used_mib.get,
            guard=SimpleNamespace(stats=lambda: {"killed": 1, "warned": 2, "denied": 0}),
            mode="kill",
            read_errors=4,
        ),
        watchdog_state=lambda: "stopped",
        journal=SimpleNamespace(write_error="cannot write the freeze journal: disk full"),
    )
    xids = XidCounts()
    for gpu, xid in ((0, 13), (0, 13), (2, 79), (0, 31), (7, 48)):  # GPU 7: not in the inventory
        xids.record(gpu, xid)
    snapshot = _tracer_snapshot()
    tracer = SimpleNamespace(snapshot=lambda: snapshot)
    index = {10: ContainerRef("uid-fixed-a", "cid-fixed-a"), 11: ContainerRef("uid-burst", "cid-burst")}
    index[12] = ContainerRef('uid-odd"name\\x', 'cid-odd"name\\x')
    index[13] = ContainerRef("uid-pending", "")
    result = CollectorRegistry(auto_describe=True)
    for collector in (
        AllocationCollector(kube, GPUS),
        HostCollector(host, NODE),
        EnforcementCollector(enforcement, GPUS, NODE),
        XidCollector(xids, GPUS, NODE),
        TracerCollector(lambda: tracer, lambda: index, lambda: SPECS, NODE),
        LegacyCollector(enforcement, lambda: SPECS, GPUS, NODE),
    ):
        result.register(collector)
    return result
