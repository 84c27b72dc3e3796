"""Which pod and container an Allocate is for (docs/reference.md, "Which pod an Allocate is for").

kubelet's Allocate carries device IDs only. Candidates are this node's Pending pods
that ask for vcuda-core with a GPU container not yet in the ledger (the ledger, not
the ``gpu-assigned`` annotation, decides: the annotation is written asynchronously
and a ledger correction may undo an assignment); a pod's candidate container is its
next GPU container (init containers first, kubelet's order) without a ledger entry,
and it must request exactly as many cores as there are IDs. Candidates rank by
``metadata.creationTimestamp`` (then namespace/name): kubelet admits the pods of one batch
oldest first, and the API server sets that field, so a pod cannot move itself ahead. The
``predicate-time`` annotation does not rank (gpu-admission's key): whoever may edit a pod may
write it, and a forged early one used to win a victim's Allocate (docs/extender.md, "What is
trusted"). The first candidate whose predicated GPUs agree with the IDs wins (an unpredicated
one always agrees); if only disagreeing ones are left, the Allocate fails naming the pod, the
container and both GPU sets. A wrong guess is still possible (two alike pods in flight at
once); PreStartContainer refuses to start a container whose Allocate answer was for another pod
(``Allocations.check_start``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass

from agent.domain.annotations import (
    GPU_ASSIGNED,
    PREDICATE_NODE,
    PREDICATE_TIME,
    is_assigned,
    predicate_key,
    predicated_gpus,
)
from agent.domain.ledger import Assignment, Ledger
from agent.errors import AllocationError
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, ContainerInfo, PodInfo


class NoMatchingPodError(AllocationError):
    """No pending pod on this node waits for a container of that size."""


class PredicateMismatchError(AllocationError):
    """The scheduler extender placed the container on other GPUs than kubelet's IDs."""


@dataclass(frozen=True)
class Candidate:
    pod: PodInfo
    container: ContainerInfo
    cores: int
    memory_mib: int | None  # the container's vcuda-memory request, None if it has none
    predicated: tuple[int, ...] | None  # GPUs chosen by the extender

    @property
    def label(self) -> str:
        return f"{self.pod.key}/{self.container.name}"


@dataclass(frozen=True)
class PodProfile:
    """A pending GPU pod's containers parsed once (quantities, predicates) and its rank."""

    pod: PodInfo
    rank: tuple[float, str]  # (creationTimestamp, namespace/name): kubelet's admission order
    containers: tuple[Candidate, ...]  # its GPU containers in kubelet's order


def next_gpu_container(pod: PodInfo, ledger: Ledger) -> ContainerInfo | None:
    """The pod's first GPU container (kubelet order) that has no ledger entry yet."""
    for container in pod.containers:
        if container.wants_gpu and ledger.get(pod.uid, container.name) is None:
            return container
    return None


def fully_placed(pod: PodInfo, ledger: Ledger) -> bool:
    """Every GPU container of the pod has its devices. kubelet allocates init containers
    first, so entries for all app containers imply the init containers had theirs (a ledger
    rebuilt from pod-resources has no init entries: kubelet does not list them)."""
    gpu = [c for c in pod.containers if c.wants_gpu]
    app = [c for c in gpu if not c.init]
    return all(ledger.get(pod.uid, c.name) is not None for c in app or gpu)


def placement_annotations(
    pod: PodInfo, ledger: Ledger, items: Iterable[Assignment], node_name: str, now_ns: int
) -> dict[str, str]:
    """The annotation updates that make the pod say what the ledger holds for it: the GPUs of
    each of ``items`` (its containers' entries), this node, a bind time unless it has one, and
    ``gpu-assigned=true`` once it is ``fully_placed``. Empty when the pod says all that already."""
    updates: dict[str, str] = {}
    for item in items:
        container = pod.container(item.container)
        if container is not None:
            key, value = predicate_key(container.index, container.init), ",".join(map(str, item.gpus))
            if pod.annotations.get(key) != value:
                updates[key] = value
    if pod.annotations.get(PREDICATE_NODE) != node_name:
        updates[PREDICATE_NODE] = node_name
    if PREDICATE_TIME not in pod.annotations:
        updates[PREDICATE_TIME] = str(now_ns)
    if not is_assigned(pod.annotations) and fully_placed(pod, ledger):
        updates[GPU_ASSIGNED] = "true"
    return updates


def profile(pod: PodInfo, node_name: str) -> PodProfile | None:
    """None unless the pod is Pending on this node, asks for vcuda-core and is not yet marked
    ``gpu-assigned=true`` (written once all its GPU containers are placed: such pods stay
    Pending for a while, and every Allocate would walk past them)."""
    if pod.node_name != node_name or pod.phase != "Pending" or pod.deleting or not pod.wants_gpu:
        return None
    if is_assigned(pod.annotations):
        return None
    items: list[Candidate] = []
    for container in pod.containers:
        if not container.wants_gpu:
            continue
        try:
            cores = container.quantity(CORE_RESOURCE)
            memory = container.quantity(MEMORY_RESOURCE) if MEMORY_RESOURCE in container.resources else None
        except ValueError:
            return None  # the API server validates quantities; a garbled one cannot be ours
        predicated = predicated_gpus(pod.annotations, container.index, container.init)
        items.append(Candidate(pod, container, cores, memory, predicated))
    return PodProfile(pod, (pod.created, pod.key), tuple(items))


def candidates_in(
    profiles: Iterable[PodProfile], assigned: Container[tuple[str, str]], size: int
) -> Iterator[Candidate]:
    """Candidates among ranked profiles, lazily: each pod's next unassigned GPU container, if
    its request is ``size`` (callers usually need only the first few)."""
    for item in profiles:
        uid = item.pod.uid
        nxt = next((c for c in item.containers if (uid, c.container.name) not in assigned), None)
        if nxt is not None and nxt.cores == size:
            yield nxt


def candidates(pods: Iterable[PodInfo], node_name: str, ledger: Ledger, size: int) -> list[Candidate]:
    """Candidates for a request of ``size`` cores, best first (one-off form of ProfileCache)."""
    ranked = sorted(filter(None, (profile(p, node_name) for p in pods)), key=lambda p: p.rank)
    return list(candidates_in(ranked, ledger.keys(), size))


class ProfileCache:
    """Ranked profiles of a pod snapshot, parsed once per pod object: an Allocate on a node
    with 1000 pods looks at each pod's identity, not its containers."""

    def __init__(self, node_name: str) -> None:
        self._node = node_name
        self._seen: dict[str, tuple[PodInfo, PodProfile | None]] = {}
        self._ranked: list[PodProfile] = []
        self._version: int | None = None

    def ranked_at(self, version: int, pods: Callable[[], Iterable[PodInfo]]) -> list[PodProfile]:
        """``ranked`` for a versioned source: nothing is re-checked while the version holds."""
        if version != self._version:
            self._ranked, self._version = self.ranked(pods()), version
        return self._ranked

    def ranked(self, pods: Iterable[PodInfo]) -> list[PodProfile]:
        changed = False
        current: dict[str, tuple[PodInfo, PodProfile | None]] = {}
        for pod in pods:
            entry = self._seen.get(pod.uid)
            if entry is None or entry[0] is not pod:
                entry = (pod, profile(pod, self._node))
                changed = changed or entry[1] is not None or self._had_profile(pod.uid)
            current[pod.uid] = entry
        if changed or any(self._seen[uid][1] is not None for uid in self._seen.keys() - current.keys()):
            self._ranked = sorted((p for _, p in current.values() if p is not None), key=lambda p: p.rank)
        self._seen = current
        return self._ranked

    def _had_profile(self, uid: str) -> bool:
        entry = self._seen.get(uid)
        return entry is not None and entry[1] is not None


def match(ranked: Iterable[Candidate], pods_seen: int, *, gpus: tuple[int, ...], node_name: str) -> Candidate:
    """The candidate an Allocate of IDs on ``gpus`` is for; raises with the reason if none."""
    first: Candidate | None = None
    for candidate in ranked:
        if candidate.predicated is None or candidate.predicated == gpus:
            return candidate
        first = first or candidate
    if first is None:
        raise NoMatchingPodError(
            f"no Pending pod on node {node_name} has a GPU container waiting for this request "
            f"(GPU {_gpus(gpus)}; {pods_seen} pods in the node's cache): the pod may not be in the "
            "watch yet, or it was deleted"
        )
    raise PredicateMismatchError(
        f"pod {first.pod.key} container {first.container.name}: the scheduler extender placed it on "
        f"GPU {_gpus(first.predicated or ())} but kubelet allocated device IDs on GPU {_gpus(gpus)}"
    )


def steer(best: Candidate | None) -> tuple[int, ...] | None:
    """The GPUs GetPreferredAllocation should prefer: the best candidate's predicated GPUs."""
    return best.predicated if best is not None else None


def _gpus(indexes: tuple[int, ...]) -> str:
    return ",".join(map(str, indexes)) or "-"
