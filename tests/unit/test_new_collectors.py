"""XID, ioctl-tracer, NVML-error and gpu-manager (legacy) collectors against fake agent state."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from agent.clock import VirtualClock
from agent.control.containers import ContainerControl, EnforcerStats
from agent.control.health import HealthMonitor
from agent.domain.annotations import Policy
from agent.domain.dutycontrol import DutyState
from agent.domain.health import HealthBoard, HealthPolicy, XidCounts
from agent.domain.specs import EnforcementSpec
from agent.errors import PlatformError
from agent.platform.bpf.ioctl_stats import IoctlSnapshot, ProcessIoctlStats, ProcessKey
from agent.platform.bpf.nvioctl import ESC_RM_ALLOC, ESC_RM_CONTROL
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import DeviceEvent, EventKind, GpuInfo
from agent.surfaces.metrics.enforcement_collector import EnforcementCollector
from agent.surfaces.metrics.legacy_collector import LegacyCollector
from agent.surfaces.metrics.tracer_collector import TracerCollector
from agent.surfaces.metrics.xid_collector import XidCollector

GPUS = [GpuInfo(i, f"GPU-{i}", "H100", 81559, i, f"0000:0{i}:00.0", 0) for i in range(2)]


def samples(collector: Collector) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]} from the collector's text exposition."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def spec(name: str, gpus: tuple[int, ...] = (0,), cores: int = 30) -> EnforcementSpec:
    whole = cores >= 100
    return EnforcementSpec(
        pod_uid=f"uid-{name}",
        namespace="ns",
        pod=name,
        container="c",
        container_id=f"cid-{name}",
        runtime="containerd",
        qos_class="Burstable",
        gpus=gpus,
        cores=cores,
        cap=None if whole else cores,
        memory_quota_mib=None if whole else 2048,
        policy=Policy.FIXED_SHARE,
    )


# XID -------------------------------------------------------------------------------------------
def test_xid_counts_per_gpu_and_xid_including_ignored_ones() -> None:
    board = HealthBoard([0, 1])
    events = [
        DeviceEvent(1, EventKind.XID, xid=79),
        DeviceEvent(1, EventKind.XID, xid=79),
        DeviceEvent(0, EventKind.XID, xid=13),  # ignored by policy, still counted
        DeviceEvent(0, EventKind.LOST),  # no XID: not counted
    ]
    backend = FakeEvents(events)
    monitor = HealthMonitor(cast(Any, backend), HealthPolicy(), board, wait_s=0)
    monitor.run(backend.stop)
    assert board.xids.snapshot() == {(1, 79): 2, (0, 13): 1}
    got = samples(XidCollector(board.xids, GPUS, "n1"))["vcuda_gpu_xid_errors_total"]
    assert ({"node": "n1", "gpu": "1", "uuid": "GPU-1", "model": "H100", "xid": "79"}, 2.0) in got
    assert ({"node": "n1", "gpu": "0", "uuid": "GPU-0", "model": "H100", "xid": "13"}, 1.0) in got
    assert not board.is_healthy(1)


class FakeEvents:
    def __init__(self, events: list[DeviceEvent]) -> None:
        self._events = events
        self.stop = threading.Event()

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        self.stop.set()  # one batch, then the monitor's loop ends
        events, self._events = self._events, []
        return events


def test_xid_counts_is_empty_family_without_events() -> None:
    assert "vcuda_gpu_xid_errors_total" not in samples(XidCollector(XidCounts(), GPUS, "n1"))


# Tracer ----------------------------------------------------------------------------------------
def proc(cgroup: int, pid: int, by_escape: dict[int, int], allocated: int) -> ProcessIoctlStats:
    return ProcessIoctlStats(
        cgroup_id=cgroup,
        pid=pid,
        calls=sum(by_escape.values()),
        errors=0,
        calls_by_escape=by_escape,
        latency_log2_ns=(0,) * 32,
        vidmem_allocs=1,
        vidmem_frees=0,
        vidmem_bytes_allocated=allocated,
        vidmem_bytes_freed=0,
        channels_created=0,
        channels_freed=0,
    )


class FakeTracer:
    def __init__(self, processes: list[ProcessIoctlStats], fail: bool = False) -> None:
        self.processes = processes
        self.fail = fail

    def snapshot(self) -> IoctlSnapshot:
        if self.fail:
            raise PlatformError("maps gone")
        return IoctlSnapshot(processes={ProcessKey(p.cgroup_id, p.pid): p for p in self.processes})


def test_tracer_metrics_sum_processes_per_container_and_escape() -> None:
    tracer = FakeTracer(
        [
            proc(100, 1, {ESC_RM_ALLOC: 3, ESC_RM_CONTROL: 5}, 1 << 20),
            proc(101, 2, {ESC_RM_ALLOC: 2}, 2 << 20),  # a subgroup of the same container
            proc(200, 3, {ESC_RM_ALLOC: 7}, 5),  # cgroup of no known container: left out
        ]
    )
    index = {100: ContainerRef("uid-a", "cid-a"), 101: ContainerRef("uid-a", "cid-a")}
    collector = TracerCollector(lambda: tracer, lambda: index, lambda: [spec("a")], "n1")
    got = samples(collector)
    calls = {s[0]["escape"]: s[1] for s in got["vcuda_container_ioctl_calls_total"]}
    assert calls == {"RM_ALLOC": 5.0, "RM_CONTROL": 5.0}
    labels, value = got["vcuda_container_gpu_memory_allocated_bytes_total"][0]
    assert labels == {"node": "n1", "namespace": "ns", "pod": "a", "container": "c"}
    assert value == float(3 << 20)


def test_no_tracer_or_failed_snapshot_gives_no_samples() -> None:
    none = TracerCollector(lambda: None, dict, list, "n1")
    assert samples(none) == {}
    failing = FakeTracer([proc(1, 1, {ESC_RM_ALLOC: 1}, 1)], fail=True)
    assert samples(TracerCollector(lambda: failing, dict, list, "n1")) == {}


def test_cgroup_index_is_cached_for_its_ttl() -> None:
    clock = VirtualClock()
    builds: list[int] = []

    def build() -> dict[int, ContainerRef]:
        builds.append(1)
        return {100: ContainerRef("uid-a", "cid-a")}

    tracer = FakeTracer([proc(100, 1, {ESC_RM_ALLOC: 1}, 1)])
    collector = TracerCollector(lambda: tracer, build, lambda: [spec("a")], "n1", clock=clock, index_ttl_s=5)
    for _ in range(3):
        samples(collector)
    assert len(builds) == 1
    clock.advance(5.0)
    samples(collector)
    assert len(builds) == 2


# NVML errors and legacy ------------------------------------------------------------------------
def fake_enforcement(controls: list[ContainerControl], memory: dict[str, int]) -> Any:
    stats = EnforcerStats(measure_errors=3)
    enforcer = SimpleNamespace(
        gpu_views=dict, controls=lambda: controls, stats=stats, measured=lambda _c: True
    )
    guard = SimpleNamespace(stats=dict)
    mem = SimpleNamespace(
        usage_by_container=lambda: memory,
        gpu_used_mib=lambda i: None,
        guard=guard,
        mode="kill",
        read_errors=2,
    )
    return SimpleNamespace(
        enforcer=enforcer,
        memory=mem,
        watchdog_state=lambda: "running",
        journal=SimpleNamespace(write_error=None),
    )


def test_nvml_errors_add_utilization_and_memory_read_failures() -> None:
    got = samples(EnforcementCollector(fake_enforcement([], {}), GPUS, "n1"))
    assert got["vcuda_nvml_errors_total"] == [({"node": "n1"}, 5.0)]


def test_legacy_names_units_and_labels() -> None:
    frac, whole = spec("a", cores=30), spec("b", gpus=(0, 1), cores=200)
    control = ContainerControl(spec=frac, key=frac.label, state=DutyState(), used=27.5)
    enforcement = fake_enforcement([control], {frac.label: 1500})
    got = samples(LegacyCollector(enforcement, lambda: [frac, whole], GPUS, "n1"))
    labels_a = {"pod_name": "a", "namespace": "ns", "node": "n1", "container_name": "c", "gpu": "0"}
    assert got["container_gpu_utilization"] == [(labels_a, 27.5)]
    assert got["container_gpu_memory_total"] == [(labels_a, 1500.0)]
    requests = {s[0]["pod_name"]: s[1] for s in got["container_request_gpu_utilization"]}
    assert requests == {"a": 30.0, "b": 200.0}
    memory = {s[0]["pod_name"]: s[1] for s in got["container_request_gpu_memory"]}
    assert memory == {"a": 2048.0, "b": 2 * 81559.0}
    assert got["container_request_gpu_memory"][1][0]["gpu"] == "0,1"
