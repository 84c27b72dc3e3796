"""/metrics render time and size for a busy node: 8 GPUs x 16 containers (128 specs and
controls), every collector built in-process from synthetic state, so the number is the cost of
building and rendering the samples (the HTTP round trip adds a fixed few hundred microseconds).

Times what /metrics serves, ``agent.surfaces.metrics.exposition.render(registry)``, over many
rounds for all collectors together, all but the legacy (gpu-manager) names that are off by
default, and each collector alone; then, for comparison, ``prometheus_client.generate_latest``
(byte-for-byte the same text) on all collectors. Target: all collectors <= 20 ms per scrape.

    .venv/bin/python bench/scrape.py [--rounds 200] [--gpus 8] [--per-gpu 16] [--seconds S]

``--seconds`` bounds each measurement's time instead of its rounds (a smoke run: --seconds 2).
Last line: RESULT scrape_ms=<wall median, all collectors> size_kb=<exposition size>
cpu_ms=<CPU median, all collectors>.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from agent.control.containers import DURATION_BUCKETS_S, ContainerControl, EnforcerStats, GpuView
from agent.control.deviceguard import GuardStats
from agent.domain.annotations import Policy
from agent.domain.dutycontrol import DutyState
from agent.domain.health import GpuHealth, XidCounts
from agent.domain.ledger import GpuUsage
from agent.domain.specs import EnforcementSpec
from agent.platform.bpf.ioctl_stats import IoctlSnapshot, ProcessIoctlStats, ProcessKey
from agent.platform.bpf.nvioctl import ESC_RM_ALLOC, ESC_RM_CONTROL, ESC_RM_FREE
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import GpuInfo
from agent.settings import GuardMode
from agent.surfaces.deviceplugin.endpoint import EndpointStatus
from agent.surfaces.metrics.collector import AgentCollector
from agent.surfaces.metrics.enforcement_collector import EnforcementCollector
from agent.surfaces.metrics.exposition import render
from agent.surfaces.metrics.host_collector import HostCollector
from agent.surfaces.metrics.kube_collector import AllocationCollector
from agent.surfaces.metrics.legacy_collector import LegacyCollector
from agent.surfaces.metrics.tracer_collector import TracerCollector
from agent.surfaces.metrics.xid_collector import XidCollector

NODE = "bench-node"
TARGET_MS = 20.0


def synthetic_state(n_gpus: int, per_gpu: int) -> dict[str, Collector]:
    """Every collector over fake agent state shaped like a full node."""
    gpus = [
        GpuInfo(i, f"GPU-{i:08d}", "NVIDIA H100 80GB HBM3", 81559, i, f"0000:{i:02x}:00.0", 0)
        for i in range(n_gpus)
    ]
    specs = [
        EnforcementSpec(
            pod_uid=f"uid-{g}-{c}",
            namespace="team-a",
            pod=f"train-{g}-{c}",
            container="worker",
            container_id=f"cid-{g}-{c}",
            runtime="containerd",
            qos_class="Burstable",
            gpus=(g,),
            cores=100 // per_gpu,
            cap=100 // per_gpu,
            memory_quota_mib=4096,
            policy=Policy.FIXED_SHARE,
        )
        for g in range(n_gpus)
        for c in range(per_gpu)
    ]
    controls = [
        ContainerControl(
            spec=s, key=s.label, state=DutyState(duty=0.5), used=6.0, goal=6.0, frozen_s=12.5, freezes=40
        )
        for s in specs
    ]
    xids = XidCounts()
    for g in range(n_gpus):
        xids.record(g, 13)
    usage = {g.index: GpuUsage(g.index, 100, 65536, 100, 81559, ()) for g in gpus}
    view = SimpleNamespace(
        node_name=NODE,
        backend_name="nvml",
        gpu_list=lambda: gpus,
        gpu_health=lambda: {g.index: GpuHealth(True, "", 0.0) for g in gpus},
        endpoint_status=lambda: EndpointStatus(True, True, 1, 0, ""),
        gpu_degraded=dict,
        call_timeouts=dict,
        visible_devices_hole=lambda: ("closed", "the toolkit ignores unprivileged NVIDIA_VISIBLE_DEVICES"),
    )
    kube = SimpleNamespace(
        node_name=NODE,
        ledger=SimpleNamespace(usage=usage.__getitem__),
        allocations=SimpleNamespace(allocations=128, refusals=0),
        recovery=SimpleNamespace(corrections=0),
        specs=lambda: specs,
    )
    stats = GuardStats(GuardMode.ENFORCE, "cgroup v2 bpf", len(specs), 0, 0, 0, 10, {})
    host = SimpleNamespace(bpf_status=lambda: "ok", guard=SimpleNamespace(stats=lambda: stats), gate=None)
    loop = EnforcerStats(
        periods=10_000, bucket_counts=[10_000] * len(DURATION_BUCKETS_S), duration_sum_s=12.0
    )
    views = {g.index: GpuView(g.index, 97.0, "nvml") for g in gpus}
    memory = {s.label: 3000 for s in specs}
    enforcement: Any = SimpleNamespace(
        enforcer=SimpleNamespace(
            gpu_views=lambda: views, controls=lambda: controls, stats=loop, measured=lambda _c: True
        ),
        memory=SimpleNamespace(
            usage_by_container=lambda: memory,
            gpu_used_mib=lambda _: 48000,
            guard=SimpleNamespace(stats=lambda: {"killed": 0, "warned": 2}),
            mode="kill",
            read_errors=0,
        ),
        watchdog_state=lambda: "running",
        journal=SimpleNamespace(write_error=None),
    )
    escapes = {ESC_RM_ALLOC: 500, ESC_RM_CONTROL: 20_000, ESC_RM_FREE: 400}
    processes = {
        ProcessKey(1000 + i, 5000 + i): ProcessIoctlStats(
            1000 + i, 5000 + i, 20_900, 0, escapes, (0,) * 32, 500, 400, 1 << 34, 1 << 33, 4, 0
        )
        for i in range(len(specs))
    }
    snapshot = IoctlSnapshot(processes=processes)
    index = {1000 + i: ContainerRef(s.pod_uid, s.container_id) for i, s in enumerate(specs)}
    tracer = SimpleNamespace(snapshot=lambda: snapshot)
    return {
        "agent": AgentCollector(view),
        "allocation": AllocationCollector(kube, gpus),
        "host": HostCollector(host, NODE),  # type: ignore[arg-type]
        "enforcement": EnforcementCollector(enforcement, gpus, NODE),
        "xid": XidCollector(xids, gpus, NODE),
        "tracer": TracerCollector(lambda: tracer, lambda: index, lambda: specs, NODE),
        "legacy": LegacyCollector(enforcement, lambda: specs, gpus, NODE),
    }


Renderer = Callable[[CollectorRegistry], bytes]


def measure(
    collectors: Sequence[Collector], rounds: int, seconds: float | None, renderer: Renderer = render
) -> tuple[list[float], list[float], int]:
    """Per-scrape milliseconds, wall and this thread's CPU (other processes crowding the
    machine move the CPU time less than the wall time), and the exposition size in bytes."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    size = len(renderer(registry))  # warm-up, and the size
    times: list[float] = []
    cpu: list[float] = []
    deadline = None if seconds is None else time.perf_counter() + seconds
    while (len(times) < rounds) if deadline is None else (time.perf_counter() < deadline or not times):
        start, start_cpu = time.perf_counter(), time.thread_time()
        renderer(registry)
        times.append((time.perf_counter() - start) * 1000)
        cpu.append((time.thread_time() - start_cpu) * 1000)
    return times, cpu, size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--per-gpu", type=int, default=16)
    parser.add_argument(
        "--seconds", type=float, default=None, help="time per measurement instead of --rounds"
    )
    args = parser.parse_args()
    collectors = synthetic_state(args.gpus, args.per_gpu)
    everything = list(collectors.values())
    rows: list[tuple[str, list[Collector], Renderer]] = [
        ("all", everything, render),
        ("all but legacy", [c for name, c in collectors.items() if name != "legacy"], render),
    ]
    rows += [(name, [c], render) for name, c in collectors.items()]
    rows.append(("all, generate_latest", everything, generate_latest))
    seconds = None if args.seconds is None else args.seconds / len(rows)
    print(f"{args.gpus} GPUs x {args.per_gpu} containers; ms per scrape: wall median, p99; CPU median; size")
    result = (0.0, 0.0, 0)
    for name, group, renderer in rows:
        times, cpu, size = measure(group, args.rounds, seconds, renderer)
        times.sort()
        median, cpu_median = statistics.median(times), statistics.median(cpu)
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(
            f"  {name:<21} {median:8.3f} ms  p99 {p99:8.3f} ms  cpu {cpu_median:8.3f} ms"
            f"  {size / 1024:7.1f} KiB  ({len(times)} rounds)"
        )
        if name == "all":
            result = (median, cpu_median, size)
    verdict = "ok" if result[0] <= TARGET_MS else f"over the {TARGET_MS:.0f} ms target"
    print(f"all collectors (legacy names included): {verdict}")
    print(f"RESULT scrape_ms={result[0]:.3f} size_kb={result[2] / 1024:.1f} cpu_ms={result[1]:.3f}")


if __name__ == "__main__":
    main()
