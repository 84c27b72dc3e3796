"""What a simulated node's GPUs look like to NVML: identity, topology, NUMA placement.

Topology of the simulated node: GPUs are split over two NUMA nodes when there are four or
more; GPUs 2k and 2k+1 on one NUMA node share a PCIe switch and, for NVLink-capable models
(H100, A100, ...), NVLinks; other GPUs on the same NUMA node meet at the NUMA node; GPUs on
different NUMA nodes meet across sockets. UUIDs are derived from the node name, index and
model, so a node keeps its GPUs' UUIDs across restarts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from agent.platform.gpu.inventory import GpuInfo, Link, Topology, TopologyLevel
from agent.platform.gpu.sim.spec import SimGpuModel

_UUID_NAMESPACE = uuid.UUID("6f0c2d9e-4c1f-4b7a-9a57-0e6d8f3b2a10")


def sim_numa_nodes(count: int) -> list[int]:
    sockets = 2 if count >= 4 else 1
    return [i * sockets // count for i in range(count)]


def sim_topology(models: Sequence[SimGpuModel]) -> Topology:
    numa = sim_numa_nodes(len(models))
    links: dict[tuple[int, int], Link] = {}
    for a in range(len(models)):
        for b in range(a + 1, len(models)):
            if numa[a] != numa[b]:
                links[(a, b)] = Link(TopologyLevel.SYSTEM)
            elif a // 2 == b // 2:
                same_model = models[a].short_name == models[b].short_name
                nvlinks = models[a].pair_nvlinks if same_model else 0
                links[(a, b)] = Link(TopologyLevel.SINGLE_SWITCH, nvlinks)
            else:
                links[(a, b)] = Link(TopologyLevel.NODE)
    return Topology(links)


def sim_uuid(node_name: str, index: int, model: SimGpuModel) -> str:
    return "GPU-" + str(uuid.uuid5(_UUID_NAMESPACE, f"{node_name}/{index}/{model.short_name}"))


def sim_gpus(node_name: str, models: Sequence[SimGpuModel]) -> tuple[GpuInfo, ...]:
    numa = sim_numa_nodes(len(models))
    return tuple(
        GpuInfo(
            index=i,
            uuid=sim_uuid(node_name, i, m),
            model=m.product_name,
            memory_mib=m.memory_mib,
            minor=i,
            pci_bus_id=f"00000000:{(0x18 + 0x10 * i) % 0x100:02X}:00.0",
            numa_node=numa[i],
        )
        for i, m in enumerate(models)
    )
