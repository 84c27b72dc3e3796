"""What a pod asks the scheduler extender for: its GPU containers and its packing policies.

A container is a GPU container when it names ``nvidia.com/vcuda-core`` or
``nvidia.com/vcuda-memory`` (in limits or requests; limits win, as kubelet reads them).
``pod_demand`` validates everything that does not depend on a node, so a request
that can never fit is refused once, with one message, instead of once per node:

- ``vcuda-core`` below 100 is a share of one GPU and needs ``vcuda-memory`` (MiB on
  that same GPU); a multiple of 100 takes that many whole GPUs, with all their memory,
  and ``vcuda-memory`` is optional (a lower bound on the chosen GPUs' memory together).
- anything else (150, 0 with memory, memory without cores, "0.5", "1Gi" of cores) is
  refused with the rule and an example of a valid request.

The pod annotations ``nvidia.com/vcuda-node-policy`` and ``nvidia.com/vcuda-gpu-policy``
(``binpack`` or ``spread``) override the extender's defaults for this pod.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from agent.domain.annotations import predicated_gpus
from agent.domain.ids import UNITS_PER_GPU
from agent.domain.requests import CORE_RULE
from agent.errors import VcudaError
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, ContainerInfo, PodInfo

NODE_POLICY = "nvidia.com/vcuda-node-policy"  # pod annotation
GPU_POLICY = "nvidia.com/vcuda-gpu-policy"  # pod annotation
DEFAULT_MAX_PER_GPU = 16
# No GPU has 16 TiB: a larger vcuda-memory is a unit mistake ("4Gi" is 4 Gi MiB).
MAX_MEMORY_MIB = 1 << 24


class PackPolicy(enum.StrEnum):
    """Where to put work: on the fullest node/GPU that fits (binpack) or the emptiest (spread)."""

    BINPACK = "binpack"
    SPREAD = "spread"


class SchedulingRequestError(VcudaError):
    """The pod's request can never be scheduled; str(err) is a message a user can act on."""


@dataclass(frozen=True)
class ContainerDemand:
    """One GPU container's request."""

    name: str
    index: int  # position in spec.containers, or spec.initContainers when init
    init: bool
    cores: int  # vcuda-core
    memory_mib: int  # vcuda-memory (0 when absent: only allowed for whole GPUs)

    @property
    def whole(self) -> bool:
        return self.cores >= UNITS_PER_GPU

    @property
    def gpu_count(self) -> int:
        return self.cores // UNITS_PER_GPU if self.whole else 1

    @property
    def key(self) -> tuple[bool, int]:
        """(init, index): names the predicate annotation of this container."""
        return (self.init, self.index)

    def describe(self) -> str:
        """``50 vcuda-core and 4096 MiB`` / ``2 whole GPUs``: for messages."""
        if not self.whole:
            return f"{self.cores} vcuda-core and {self.memory_mib} MiB"
        gpus = f"{self.gpu_count} whole GPU{'s' if self.gpu_count > 1 else ''}"
        return f"{gpus} with {self.memory_mib} MiB together" if self.memory_mib else gpus


@dataclass(frozen=True)
class PodDemand:
    """A pod's GPU containers (init containers first, then app containers) and policies."""

    containers: tuple[ContainerDemand, ...]
    node_policy: PackPolicy | None  # the pod's annotation, None = the extender's default
    gpu_policy: PackPolicy | None

    @property
    def app(self) -> tuple[ContainerDemand, ...]:
        return tuple(c for c in self.containers if not c.init)

    @property
    def init(self) -> tuple[ContainerDemand, ...]:
        return tuple(c for c in self.containers if c.init)


def pod_demand(pod: PodInfo) -> PodDemand | None:
    """None when no container asks for nvidia.com/vcuda-core or nvidia.com/vcuda-memory (the pod
    passes through untouched). Raises SchedulingRequestError for requests that can never fit any
    node: bad core count (CORE_RULE), memory without cores, fractional cores without memory,
    malformed quantities, unknown policy annotation values. Every problem is named at once."""
    problems: list[str] = []
    containers: list[ContainerDemand] = []
    for info in pod.containers:
        if CORE_RESOURCE not in info.resources and MEMORY_RESOURCE not in info.resources:
            continue
        demand = _container_demand(info, problems)
        if demand is not None:
            containers.append(demand)
    if not containers and not problems:
        return None
    node_policy = _policy(pod, NODE_POLICY, problems)
    gpu_policy = _policy(pod, GPU_POLICY, problems)
    if problems:
        raise SchedulingRequestError(f"pod {pod.key}: " + "; ".join(problems))
    return PodDemand(tuple(containers), node_policy, gpu_policy)


def placed_gpus(demand: PodDemand, annotations: Mapping[str, str]) -> dict[tuple[bool, int], tuple[int, ...]]:
    """The GPUs the pod's predicate annotations name, per container key (what ``ClusterBook.charge``
    takes); containers without a (readable) annotation are left out: their GPU is not known yet."""
    found: dict[tuple[bool, int], tuple[int, ...]] = {}
    for c in demand.containers:
        gpus = predicated_gpus(annotations, c.index, c.init)
        if gpus:
            found[c.key] = gpus
    return found


def _container_demand(info: ContainerInfo, problems: list[str]) -> ContainerDemand | None:
    where = f"{'init container' if info.init else 'container'} {info.name}"
    cores = _quantity(info, CORE_RESOURCE, where, problems)
    memory = _quantity(info, MEMORY_RESOURCE, where, problems)
    if cores is None or memory is None:
        return None
    if cores == 0 and memory == 0:
        return None  # asks for nothing (explicit zeros): nothing to place
    if cores == 0:
        problems.append(
            f"{where} asks for {memory} MiB of {MEMORY_RESOURCE} but no {CORE_RESOURCE}: "
            f"memory comes with a share of a GPU, e.g. {CORE_RESOURCE}: 50 with {MEMORY_RESOURCE}: {memory}"
        )
        return None
    if cores > UNITS_PER_GPU and cores % UNITS_PER_GPU:
        problems.append(
            f"{where} asks for {cores} {CORE_RESOURCE}: {CORE_RULE}, e.g. 50 or "
            f"{cores // UNITS_PER_GPU * UNITS_PER_GPU}"
        )
        return None
    if cores < UNITS_PER_GPU and memory == 0:
        problems.append(
            f"{where} asks for {cores} {CORE_RESOURCE} (a share of one GPU) without {MEMORY_RESOURCE}: "
            f"a share needs its GPU memory in MiB, e.g. {MEMORY_RESOURCE}: 4096"
        )
        return None
    if memory > MAX_MEMORY_MIB:
        problems.append(
            f"{where} asks for {memory} MiB of {MEMORY_RESOURCE}, more than any GPU has: "
            f"{MEMORY_RESOURCE} counts MiB, write 4096 for 4 GiB"
        )
        return None
    return ContainerDemand(info.name, info.index, info.init, cores, memory)


def _quantity(info: ContainerInfo, resource: str, where: str, problems: list[str]) -> int | None:
    try:
        return info.quantity(resource)
    except ValueError:
        unit = "percent of one GPU, e.g. 50" if resource == CORE_RESOURCE else "MiB, e.g. 4096"
        text = info.resources[resource]
        problems.append(f"{where}: {resource}={text!r} is not a whole number ({resource} counts {unit})")
        return None


def _policy(pod: PodInfo, annotation: str, problems: list[str]) -> PackPolicy | None:
    text = pod.annotations.get(annotation)
    if text is None:
        return None
    try:
        return PackPolicy(text.strip())
    except ValueError:
        valid = " or ".join(p.value for p in PackPolicy)
        problems.append(f"annotation {annotation}={text!r} is not a policy (use {valid})")
        return None
