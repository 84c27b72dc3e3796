"""Allocate ↔ pod: match kubelet's device IDs to a pod's container, record it in the
ledger, annotate the pod, and release shares when pods finish or go away.

Allocate cannot know which pod it is for (matching.py guesses, kubelet's pod-resources tells
later). kubelet keeps Allocate's answer and starts the container with it, so each answer is
remembered with the container it was built for: PreStartContainer refuses IDs whose answer
was for another container than the one kubelet starts (``check_start``). The ledger is
corrected either way (recovery.py); the refusal keeps a container from running with another
pod's environment (its MPS limits, its memory quota)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from agent.control.annotator import Annotator
from agent.control.kubeports import EventSink, PodSource
from agent.domain.annotations import AnnotationError, wants_isolation
from agent.domain.ids import IdTable
from agent.domain.ledger import Assignment, Ledger
from agent.domain.matching import Candidate, ProfileCache, candidates_in, match, placement_annotations, steer
from agent.domain.placement import Placer
from agent.domain.requests import ResolvedRequest, is_whole
from agent.errors import AllocationError, InsufficientCapacityError, VcudaError, WrongPodStartError
from agent.platform.kube.pods import PodInfo

log = logging.getLogger(__name__)

PodListener = Callable[[PodInfo], object]
MAX_ANSWERS = 4096  # Allocate answers remembered for PreStartContainer (one per container start)


class Allocations:
    """The Kubernetes side of Allocate and GetPreferredAllocation."""

    def __init__(
        self,
        *,
        node_name: str,
        table: IdTable,
        placer: Placer,
        ledger: Ledger,
        pods: PodSource,
        annotator: Annotator,
        events: EventSink,
        wait_for_pod_s: float = 3.0,
    ) -> None:
        self.node_name = node_name
        self._table = table
        self._placer = placer
        self.ledger = ledger
        self._pods = pods
        self._annotator = annotator
        self._events = events
        self._wait_s = wait_for_pod_s
        self._lock = threading.Lock()  # matching + ledger update are one step
        self._profiles = ProfileCache(node_name)
        self._answers: OrderedDict[frozenset[str], Assignment] = OrderedDict()  # guarded by _lock
        self.on_assigned: list[PodListener] = []
        # GPUs that serve hardware-isolated shares only (mig.onDemand, in MIG mode): a pod
        # annotated for isolation is steered to them, any other pod away (control/migshares.py).
        self.isolated_gpus: Callable[[], frozenset[int]] = frozenset
        self.allocations = 0
        self.refusals = 0
        # Pods refused at Allocate (kubelet rejects such a pod for good: it is Failed, never
        # admitted again) rank after every other candidate from the refusal on, not only once
        # the pod cache sees them Failed: the next pod asking the same size is not taken for it.
        self._refused: OrderedDict[str, None] = OrderedDict()  # pod UIDs; guarded by _lock

    # GetPreferredAllocation ---------------------------------------------------
    def prefer(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Steer to the extender's GPU, or to a GPU whose ledger has room for the best
        candidate's memory; otherwise the plain placement."""
        best = self._best(size, fresh=True) or self._await_best(size)
        available = self._by_isolation(best, available)
        target = steer(best)
        if target is None and best is not None and not is_whole(size):
            target = self._roomy_gpus(best, available)
        if target:
            narrowed = [
                d
                for d, (gpu, _) in zip(available, self._table.locate_all(available), strict=True)
                if gpu in target
            ]
            try:
                return self._placer.preferred(narrowed, must_include, size)
            except VcudaError as err:
                log.info("GetPreferredAllocation: cannot steer to GPU %s (%s); plain placement", target, err)
        return self._placer.preferred(available, must_include, size)

    def _by_isolation(self, best: Candidate | None, available: Sequence[str]) -> Sequence[str]:
        """The IDs on GPUs of the kind the pod asks for (isolated or not), when there are any."""
        isolated = self.isolated_gpus()
        if best is None or not isolated:
            return available
        try:
            wanted = wants_isolation(best.pod.annotations)
        except AnnotationError:
            return available  # Allocate refuses it, with why
        kept = [
            d
            for d, (gpu, _) in zip(available, self._table.locate_all(available), strict=True)
            if (gpu in isolated) == wanted
        ]
        return kept or available

    def _roomy_gpus(self, candidate: Candidate, available: Sequence[str]) -> tuple[int, ...]:
        need = candidate.memory_mib or 0
        gpus = {gpu for gpu, _ in self._table.locate_all(available)}
        return tuple(sorted(g for g in gpus if self.ledger.free(g, candidate.pod.uid)[1] >= need))

    # Allocate -------------------------------------------------------------------
    def allocate(self, device_ids: Sequence[str], resolved: ResolvedRequest) -> Assignment:
        """Assign the IDs to a pod's container; AllocationError (with the reason) if none fits."""
        if self._best(resolved.cores, fresh=True) is None:
            self._await_best(resolved.cores)
        try:
            with self._lock:
                item, pod = self._assign(device_ids, resolved)
                self._remember(item)
        except AllocationError:
            self.refusals += 1
            raise
        self.allocations += 1
        self._annotate(pod, item)
        log.info(
            "Allocate: %s gets %d vcuda-core on GPU %s, %s",
            item.label,
            item.cores,
            ",".join(map(str, item.gpus)),
            "whole GPUs" if item.whole else f"{item.memory_mib} MiB quota",
        )
        for listener in self.on_assigned:
            listener(pod)
        return item

    def _assign(self, device_ids: Sequence[str], resolved: ResolvedRequest) -> tuple[Assignment, PodInfo]:
        gpus = tuple(g.index for g in resolved.gpus)
        chosen = match(*self._ranked(resolved.cores), gpus=gpus, node_name=self.node_name)
        try:
            return self._assign_to(chosen, device_ids, resolved, gpus)
        except AllocationError:
            self._refused[chosen.pod.uid] = None
            while len(self._refused) > MAX_ANSWERS:
                self._refused.popitem(last=False)
            raise

    def _assign_to(
        self, chosen: Candidate, device_ids: Sequence[str], resolved: ResolvedRequest, gpus: tuple[int, ...]
    ) -> tuple[Assignment, PodInfo]:
        if not resolved.whole and chosen.memory_mib is None:
            raise AllocationError(
                f"pod {chosen.pod.key} container {chosen.container.name} requests {resolved.cores} "
                "vcuda-core (a share of one GPU) but no nvidia.com/vcuda-memory: a share needs a "
                "memory quota in MiB, e.g. nvidia.com/vcuda-memory: 2048"
            )
        item = Assignment(
            pod_uid=chosen.pod.uid,
            namespace=chosen.pod.namespace,
            pod=chosen.pod.name,
            container=chosen.container.name,
            init=chosen.container.init,
            gpus=gpus,
            cores=resolved.cores,
            memory_mib=0 if resolved.whole else (chosen.memory_mib or 0),
            device_ids=frozenset(device_ids),
        )
        try:
            self.ledger.assign(item)
        except InsufficientCapacityError as err:
            self._events.pod(chosen.pod, "GPUOversubscribed", str(err))
            raise
        return item, chosen.pod

    def _remember(self, item: Assignment) -> None:
        self._answers[item.device_ids] = item
        self._answers.move_to_end(item.device_ids)
        while len(self._answers) > MAX_ANSWERS:
            self._answers.popitem(last=False)

    def forget(self, item: Assignment) -> None:
        """An Allocate that failed as a whole: kubelet does not keep this answer."""
        with self._lock:
            if self._answers.get(item.device_ids) is item:
                del self._answers[item.device_ids]

    def pod_of(self, item: Assignment) -> PodInfo | None:
        """The pod an assignment was made for, as the pod cache has it."""
        return self._pods.get(item.pod_uid) or self._pods.find(item.namespace, item.pod)

    def pod_event(self, item: Assignment, reason: str, message: str) -> None:
        """A Warning Event on the assignment's pod."""
        pod = self.pod_of(item)
        if pod is not None:
            self._events.pod(pod, reason, message)

    # PreStartContainer --------------------------------------------------------------
    def check_start(self, device_ids: Sequence[str], owner: tuple[str, str, str] | None) -> None:
        """Raise WrongPodStartError when kubelet starts ``owner`` (namespace, pod, container,
        from its pod-resources) with IDs whose Allocate answer was built for another container:
        kubelet would run it with that answer's environment. ``owner`` None (kubelet could
        not tell) passes: nothing contradicts the answer."""
        with self._lock:
            answer = self._answers.get(frozenset(device_ids))
        if answer is None or owner is None or (answer.namespace, answer.pod, answer.container) == owner:
            return
        namespace, name, container = owner
        held = self.ledger.holder_of(device_ids[0]) if device_ids else None  # corrected by now
        alike = held is not None and _same_answer(held, answer)
        if held is not None and alike and (held.namespace, held.pod, held.container) == owner:
            # Two alike pods guessed the other way round: the answer carries nothing that
            # differs between them, and the ledger now names the right one.
            log.info(
                "PreStartContainer: %s starts with the answer made for %s (alike)", held.label, answer.label
            )
            return
        message = (
            f"kubelet starts pod {namespace}/{name} container {container} with device IDs whose "
            f"Allocate answer was made for {answer.label} (two pods asking for {answer.cores} "
            "vcuda-core were pending at once and the agent guessed wrong): starting it would give "
            "it the other pod's environment, so PreStartContainer refuses; delete the pod (its "
            "controller re-creates it) and it is allocated again"
        )
        starting = self._pods.find(namespace, name)
        if starting is not None:
            self._events.pod(starting, "GPUAllocationMismatch", message)
        raise WrongPodStartError(message)

    def _await_best(self, size: int) -> Candidate | None:
        """kubelet admits a pod as soon as its own watch sees it; ours may be a moment behind.
        Waits (at most ``wait_for_pod_s``) for a candidate not refused before: a pod refused
        a moment ago is still Pending in the cache, and the pod asking now is another one."""
        self._pods.wait_for(lambda: self._best(size, fresh=True) is not None, self._wait_s)
        return self._best(size)

    def _best(self, size: int, *, fresh: bool = False) -> Candidate | None:
        """The best candidate; ``fresh``: None where only pods refused before ask ``size``."""
        with self._lock:
            best = next(self._ranked(size)[0], None)
            return None if fresh and best is not None and best.pod.uid in self._refused else best

    def _ranked(self, size: int) -> tuple[Iterator[Candidate], int]:
        """(candidates best first, pods in the cache); the caller holds self._lock (the profile
        cache needs it)."""
        version, pods = self._pods.snapshot()
        ranked = self._profiles.ranked_at(version, lambda: pods)
        if self._refused:  # after every other candidate (kubelet does not retry a refused pod)
            ranked = sorted(ranked, key=lambda p: p.pod.uid in self._refused)
        return candidates_in(ranked, self.ledger.keys(), size), len(pods)

    def _annotate(self, pod: PodInfo, item: Assignment) -> None:
        updates = placement_annotations(pod, self.ledger, [item], self.node_name, time.time_ns())
        if updates:
            self._annotator.submit(pod, updates)

    # Pod lifecycle ---------------------------------------------------------------
    def on_pod_event(self, kind: str, old: PodInfo | None, new: PodInfo | None) -> None:
        """Pod cache subscriber: finished or deleted pods give their shares back; init
        containers' shares go once the pod runs (they have all completed by then)."""
        pod = new or old
        if pod is None:
            return
        if kind == "DELETED":
            with self._lock:
                self._refused.pop(pod.uid, None)
        if kind == "DELETED" or (new is not None and new.finished):
            for item in self.ledger.release(pod.uid):
                log.info(
                    "released %s: %d cores on GPU %s (pod %s)",
                    item.label,
                    item.cores,
                    ",".join(map(str, item.gpus)),
                    "deleted" if kind == "DELETED" else new and new.phase,
                )
        elif new is not None and new.phase == "Running":
            for item in self.ledger.of_pod(pod.uid):
                if item.init:
                    self.ledger.release(pod.uid, item.container)


def _same_answer(a: Assignment, b: Assignment) -> bool:
    """Whether Allocate would have answered both containers alike: everything the answer's
    environment (and the MPS grant built from it) depends on is equal."""

    def profile(x: Assignment) -> tuple[object, ...]:
        return (x.gpus, x.cores, x.memory_mib, x.policy, x.limit)

    return profile(a) == profile(b)
