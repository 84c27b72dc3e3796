"""The tracer collector over the real eBPF ioctl tracer: a real process in a real cgroup v2
group issues NVIDIA-shaped ioctls; its calls and allocated bytes show up under its container."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.platform.bpf import nvioctl as nv
from agent.platform.bpf.ioctl_tracer import IoctlTracer
from agent.platform.cgroups.paths import ContainerRef
from agent.surfaces.metrics.tracer_collector import TracerCollector
from tests.integration.test_ioctl_tracer import (  # noqa: F401 (fixtures)
    Child,
    MiB,
    Plan,
    make_cgroup,
    run_plan,
    spawn,
    tracer,
)

pytestmark = pytest.mark.privileged


def test_a_real_process_calls_show_up_under_its_container(
    tracer: IoctlTracer,  # noqa: F811
    make_cgroup: Callable[[str], Path],  # noqa: F811
    spawn: Callable[..., Child],  # noqa: F811
) -> None:
    group = make_cgroup("metrics")
    plan = Plan()
    for i in range(3):
        plan.alloc(0xC1D00001, 0x1000 + i, nv.NV01_MEMORY_LOCAL_USER, (i + 1) * 2 * MiB)
    for _ in range(4):
        plan.other(nv.RM_CONTROL)
    child = run_plan(spawn, plan, group)
    ref = ContainerRef("uid-m", "cid-m")
    spec = EnforcementSpec(
        pod_uid=ref.pod_uid,
        namespace="team",
        pod="trainer",
        container="cuda",
        container_id=ref.container_id,
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=20,
        cap=20,
        memory_quota_mib=1024,
        policy=Policy.FIXED_SHARE,
    )
    index = {group.stat().st_ino: ref}  # a v2 cgroup's id is its directory's inode
    registry = CollectorRegistry()
    registry.register(TracerCollector(lambda: tracer, lambda: index, lambda: [spec], "n1"))
    text = generate_latest(registry).decode()
    child.finish()
    got = {
        (s.name, s.labels.get("escape", "")): (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    container = {"node": "n1", "namespace": "team", "pod": "trainer", "container": "cuda"}
    assert got[("vcuda_container_ioctl_calls_total", "RM_ALLOC")] == (
        {**container, "escape": "RM_ALLOC"},
        3.0,
    )
    assert got[("vcuda_container_ioctl_calls_total", "RM_CONTROL")][1] == 4.0
    assert got[("vcuda_container_gpu_memory_allocated_bytes_total", "")] == (container, float(12 * MiB))
    # Nothing else on the machine is attributed to this container.
    assert {k[0] for k in got} == {
        "vcuda_container_ioctl_calls_total",
        "vcuda_container_gpu_memory_allocated_bytes_total",
    }
    assert len([k for k in got if k[0] == "vcuda_container_ioctl_calls_total"]) == 2
