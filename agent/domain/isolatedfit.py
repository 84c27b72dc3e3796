"""Where a pod asking for hardware-isolated shares (``nvidia.com/vcuda-isolation: mig``) fits,
as the scheduler extender decides it from a node's inventory annotation.

Only GPUs that serve isolated shares on demand (``mig.onDemand``: in MIG mode and offering
vcuda-core, ``"onDemand": true`` in their ``mig`` entry) take them, and they take nothing
else (``gpufit`` gives them no capacity for other pods). A container fits such a GPU when
the smallest MIG profile covering its cores and memory still fits beside the GPU's
instances (``domain/migfit.py``, the rule the agent's Allocate applies). The app containers
of a pod are placed one after the other, each beside the instances the previous ones would
get; init containers each on their own. The GPU with the least room left that fits is
chosen (binpack), then the lowest index.

Pods placed on a node but not yet allocated there are not counted: the inventory shows the
instances the agent has made. Two pods that pass for the node's last slot at once: the
second's Allocate is refused with the rule and an Event.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.domain.migfit import MigFit, smallest_fit, why_not
from agent.domain.miginventory import entry_instances
from agent.domain.nodeinventory import GpuEntry, NodeInventory
from agent.domain.schedrequest import ContainerDemand, PodDemand
from agent.platform.gpu.migprofiles import GpuInstanceProfile, MigProduct, Placement, product_for

GpuKey = tuple[bool, int]  # ContainerDemand.key
Instances = list[tuple[GpuInstanceProfile, Placement]]

NO_ON_DEMAND = (
    "no GPU of the node serves hardware-isolated shares (the node config's mig.onDemand, in MIG mode)"
)


def on_demand_gpus(inventory: NodeInventory) -> list[tuple[GpuEntry, MigProduct]]:
    """The node's healthy on-demand GPUs with their MIG product."""
    found = []
    for g in inventory.gpus:
        if g.mig is None or not g.mig.on_demand or not g.healthy:
            continue
        product = product_for(g.model, g.memory_mib)
        if product is not None:
            found.append((g, product))
    return found


def isolated_fit(
    inventory: NodeInventory, demand: PodDemand
) -> tuple[dict[GpuKey, tuple[int, ...]] | None, str]:
    """(the GPU per container, "") when every container gets a MIG instance, else (None, why)."""
    whole = [c for c in demand.containers if c.whole]
    if whole:
        return None, (
            f"container {whole[0].name} asks for {whole[0].describe()}: a hardware-isolated share is "
            "below 100 vcuda-core (a MIG instance of one GPU)"
        )
    gpus = on_demand_gpus(inventory)
    if not gpus:
        return None, NO_ON_DEMAND
    base = {g.index: entry_instances(product, g.mig) for g, product in gpus if g.mig is not None}
    planned = {index: list(instances) for index, instances in base.items()}
    placement: dict[GpuKey, tuple[int, ...]] = {}
    for c in demand.containers:
        existing = base if c.init else planned
        chosen = _choose(gpus, existing, c)
        if chosen is None:
            return None, _why(gpus, existing, c)
        index, fit = chosen
        if not c.init:
            planned[index].append((fit.profile, fit.placement))
        placement[c.key] = (index,)
    return placement, ""


def _choose(
    gpus: Sequence[tuple[GpuEntry, MigProduct]], existing: dict[int, Instances], c: ContainerDemand
) -> tuple[int, MigFit] | None:
    best: tuple[int, int, MigFit] | None = None
    for g, product in gpus:
        fit = smallest_fit(product, c.cores, c.memory_mib, existing[g.index])
        if fit is None:
            continue
        used = sum(p.memory_slices for p, _ in existing[g.index])
        if best is None or used > best[0]:
            best = (used, g.index, fit)
    return None if best is None else (best[1], best[2])


def _why(
    gpus: Sequence[tuple[GpuEntry, MigProduct]], existing: dict[int, Instances], c: ContainerDemand
) -> str:
    reasons = []
    for g, product in gpus:
        left = existing[g.index]
        text = why_not(product, c.cores, c.memory_mib)
        if left:
            text += f" (it has {', '.join(p.name for p, _ in left)})"
        reasons.append(f"GPU {g.index}: {text}")
    return f"container {c.name} ({c.describe()}): " + "; ".join(reasons)
