"""Builders for the scheduler extender's domain tests: inventories, demands, a charged book."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from agent.domain.clusterbook import ClusterBook
from agent.domain.nodeinventory import GpuEntry, NodeInventory
from agent.domain.schedrequest import ContainerDemand, PackPolicy, PodDemand
from agent.platform.gpu.inventory import Link, TopologyLevel

NOW = 1_800_000_000.0
MIB = 10_000  # schedulable MiB of a test GPU
_UIDS = itertools.count()


def inventory(
    name: str,
    count: int = 1,
    *,
    memory: Sequence[int] | None = None,
    unhealthy: Sequence[int] = (),
    nvlinks: Mapping[tuple[int, int], int] | None = None,
    heartbeat: float = NOW,
) -> NodeInventory:
    """``count`` GPUs of ``MIB`` schedulable MiB (or ``memory[i]``), PCIe SYSTEM links between all
    of them except the NVLink pairs in ``nvlinks`` ({(a, b): links})."""
    sizes = list(memory) if memory is not None else [MIB] * count
    pairs = {frozenset(p): n for p, n in (nvlinks or {}).items()}

    def link(a: int, b: int) -> Link:
        n = pairs.get(frozenset((a, b)), 0)
        return Link(TopologyLevel.SINGLE_SWITCH if n else TopologyLevel.SYSTEM, n)

    gpus = tuple(
        GpuEntry(
            index=i,
            uuid=f"GPU-{name}-{i}",
            model="test GPU",
            memory_mib=size,
            schedulable_mib=size,
            numa=0,
            healthy=i not in unhealthy,
            links={j: link(i, j) for j in range(len(sizes)) if j != i},
        )
        for i, size in enumerate(sizes)
    )
    return NodeInventory(node=name, heartbeat=heartbeat, memory_scaling=1.0, gpus=gpus)


def share(cores: int, memory: int, name: str = "c", index: int = 0, init: bool = False) -> ContainerDemand:
    return ContainerDemand(name, index, init, cores, memory)


def pod(
    *containers: ContainerDemand,
    node_policy: PackPolicy | None = None,
    gpu_policy: PackPolicy | None = None,
) -> PodDemand:
    return PodDemand(tuple(containers), node_policy, gpu_policy)


def one(cores: int, memory: int = 0, **policies: PackPolicy | None) -> PodDemand:
    """A pod with one app container."""
    return pod(share(cores, memory), **policies)


def use(book: ClusterBook, node: str, gpu: int, cores: int, memory: int = 0, *, uid: str = "") -> str:
    """Charge a placed pod of ``cores``/``memory`` on ``gpu``; returns its uid."""
    uid = uid or f"used-{next(_UIDS)}"
    book.charge(uid, node, one(cores, memory), {(False, 0): (gpu,)})
    return uid
