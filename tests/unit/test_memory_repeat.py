"""A full memory check that reads exactly what the last one judged, with nobody over or near a
quota, judges nothing anew (``MemoryIntegration.repeats``); any change in what it reads (a
process's bytes, a reused pid, a new container, the tracer's bytes) is judged in full, and so
is every check after one that found a container over its quota.

The node around the integration is faked at its seams (the backend's per-process memory, the
process cache's identities, the pod specs); the guard and the cadence are the real ones, in
audit mode so that an over-quota verdict is recorded rather than a process signalled."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from agent.clock import VirtualClock
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import GpuInfo, ProcessMemory
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.settings import EnforcementSettings, MemoryQuotaMode
from agent.surfaces.memorynode import MemoryIntegration
from agent.surfaces.statusview import ActionLog

MIB = 1 << 20


def spec(name: str, quota_mib: int = 1024) -> EnforcementSpec:
    return EnforcementSpec(
        pod_uid=f"uid-{name}",
        namespace="ns",
        pod=name,
        container="main",
        container_id=f"cid-{name}",
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=50,
        cap=50,
        memory_quota_mib=quota_mib,
        policy=Policy.FIXED_SHARE,
    )


@dataclass
class Node:
    """The seams: what NVML lists on GPU 0, who each pid is, which pods run."""

    memory: list[ProcessMemory] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)  # pid -> start ticks
    owners: dict[int, ContainerRef] = field(default_factory=dict)
    specs: list[EnforcementSpec] = field(default_factory=list)
    reads: int = 0

    def process_memory(self, index: int) -> list[ProcessMemory]:
        self.reads += 1
        return list(self.memory)

    def memory_limits_support(self) -> str | None:
        return "not in this test"

    def identity(self, pid: int) -> ProcessIdentity | None:
        start = self.starts.get(pid)
        return None if start is None else ProcessIdentity(pid, start)

    def run(self, name: str, pid: int, mib: int, start: int = 100) -> None:
        self.starts[pid] = start
        self.owners[pid] = ContainerRef(f"uid-{name}", f"cid-{name}")
        self.memory = [m for m in self.memory if m.pid != pid] + [ProcessMemory(pid, mib * MIB)]


def integration(node: Node, clock: VirtualClock) -> MemoryIntegration:
    host = SimpleNamespace(
        facts=SimpleNamespace(layout=SimpleNamespace(v2_root=Path("/sys/fs/cgroup"))),
        tracer=None,
        processes=SimpleNamespace(identity=node.identity, get=node.owners.get),
    )
    kube = SimpleNamespace(specs=lambda: list(node.specs), pods={}, events=None)
    return MemoryIntegration(
        EnforcementSettings(memory_mode=MemoryQuotaMode.AUDIT),
        backend=cast(Any, node),
        gpus=[GpuInfo(0, "GPU-0", "sim", 81920, 0, "0000:00:00.0", None)],
        host=cast(Any, host),
        kube=cast(Any, kube),
        actions=ActionLog(),
        procfs=ProcFS(),
        clock=clock,
    )


def checks(memory: MemoryIntegration, clock: VirtualClock, n: int = 1) -> int:
    """``n`` full checks 0.2 s apart, as the loop makes them; returns how many were repeats."""
    before = memory.repeats
    for _ in range(n):
        clock.advance(0.2)
        memory.check_once()
    return memory.repeats - before


def settled(memory: MemoryIntegration, clock: VirtualClock) -> None:
    """A container first seen is checked at the short period for a second (its rate is not
    known): past that, a still container is quiet."""
    checks(memory, clock, 6)
    assert not memory.cadence.fast()


def audits(memory: MemoryIntegration) -> list[str]:
    return [a.key for a in memory.guard.recent_actions]


def test_the_same_reading_again_is_not_judged_again_and_any_change_is() -> None:
    node, clock = Node(specs=[spec("a"), spec("b")]), VirtualClock()
    node.run("a", 10, 300)
    node.run("b", 20, 500)
    memory = integration(node, clock)
    assert checks(memory, clock) == 0  # new containers: near until their rate is known
    settled(memory, clock)
    assert checks(memory, clock, 3) == 3
    assert memory.usage_by_container() == {"ns/a/main": 300, "ns/b/main": 500}

    node.run("b", 20, 2000)  # over its quota: judged at once
    assert checks(memory, clock) == 0
    assert audits(memory) == ["ns/b/main"]
    assert checks(memory, clock, 3) == 0  # the same reading, someone over: judged, said once
    assert audits(memory) == ["ns/b/main"]
    assert memory.usage_by_container()["ns/b/main"] == 2000

    node.run("b", 20, 400)  # back under: quiet again once its shrink is judged
    assert checks(memory, clock) == 0
    assert checks(memory, clock, 2) == 2
    assert memory.usage_by_container()["ns/b/main"] == 400


def test_a_reused_pid_or_a_new_container_is_judged_in_full() -> None:
    node, clock = Node(specs=[spec("a")]), VirtualClock()
    node.run("a", 10, 300)
    memory = integration(node, clock)
    settled(memory, clock)
    assert checks(memory, clock) == 1
    node.starts[10] = 999  # pid 10 is another process now, holding the same bytes
    assert checks(memory, clock) == 0
    assert checks(memory, clock) == 1
    node.specs.append(spec("c", quota_mib=256))
    node.run("c", 30, 100)
    assert checks(memory, clock) == 0
    assert memory.usage_by_container() == {"ns/a/main": 300, "ns/c/main": 100}
    settled(memory, clock)
    reads = node.reads
    assert checks(memory, clock) == 1
    assert node.reads == reads + 1  # a repeat still reads NVML: that is how it knows
