"""Enforcement specs for every GPU container in the ledger, with Events for bad annotations.

The compute-cap loop and the memory guard read ``specs()`` each control period. An invalid
``vcuda-core-limit`` or ``vcuda-policy`` becomes one Kubernetes Event per pod and
problem (not one per period) and the safe default in the spec; a valid one beyond the
node's bounds (``SpecBounds``, the admin's) becomes the bounded value and one Event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from agent.control.kubeports import EventSink, PodSource
from agent.domain.annotations import POLICY, Policy
from agent.domain.ledger import Assignment, Ledger
from agent.domain.specs import EnforcementSpec, SpecBounds, build_spec, node_policy
from agent.platform.kube.pods import PodInfo

log = logging.getLogger(__name__)

INVALID_ANNOTATION = "InvalidGPUAnnotation"
BOUNDED_ANNOTATION = "GPUAnnotationBounded"

# (ledger version, labels object, bounds, {pod uid: PodInfo seen}, specs) of the last build
_Built = tuple[int, Mapping[str, str], SpecBounds, dict[str, PodInfo | None], tuple[EnforcementSpec, ...]]


class SpecBook:
    def __init__(
        self,
        ledger: Ledger,
        pods: PodSource,
        events: EventSink,
        node_name: str,
        node_labels: Callable[[], Mapping[str, str]] = dict,
        *,
        bounds: Callable[[], SpecBounds] = SpecBounds,
    ) -> None:
        self._ledger = ledger
        self._pods = pods
        self._events = events
        self._node = node_name
        self._node_labels = node_labels
        self._bounds = bounds
        self._lock = threading.Lock()
        self._reported: set[tuple[str, str]] = set()  # (pod uid or "node", problem)
        self._cache: _Built | None = None
        self._pods_version = -1  # the pod cache's version when the cached specs were last found valid

    def default_policy(self) -> Policy:
        policy, problem = node_policy(self._node_labels().get(POLICY), self._node)
        if problem and self._first_time("node", problem):
            log.warning("%s; using %s", problem, policy)
            self._events.node(INVALID_ANNOTATION, f"{problem}; pods on this node default to {policy}")
        return policy

    def specs(self) -> list[EnforcementSpec]:
        """Every ledger container's spec. The enforcer, the memory guard and every scrape ask
        several times a second, so the list is rebuilt only when the ledger, one of its pods
        (PodInfo objects are replaced, never changed) or the node labels changed. The pods
        are compared one by one only when the pod cache's version moved: at 128 containers,
        comparing them at every call cost 141 us, nine calls a second."""
        labels = self._node_labels()
        bounds = self._bounds()
        version = self._ledger.version
        pods_version = self._pods.version()  # before the read: a change meanwhile rebuilds next time
        with self._lock:
            cached, seen_pods = self._cache, self._pods_version
        if self._still_valid(cached, version, labels, bounds, pods_version != seen_pods):
            assert cached is not None
            with self._lock:
                if self._cache is cached:  # not replaced meanwhile by another caller's build
                    self._pods_version = pods_version
            return list(cached[4])
        default = self.default_policy()
        items = self._ledger.assignments()
        pods = {item.pod_uid: self._pods.get(item.pod_uid) for item in items}
        out = [build_spec(item, pods[item.pod_uid], default, bounds) for item in items]
        for spec in out:
            self._report(spec)
        with self._lock:
            self._cache, self._pods_version = (version, labels, bounds, pods, tuple(out)), pods_version
        return out

    def spec_for(self, item: Assignment) -> EnforcementSpec:
        """One ledger entry's spec now (Allocate asks, before the entry is in ``specs()``)."""
        return build_spec(item, self._pods.get(item.pod_uid), self.default_policy(), self._bounds())

    def _still_valid(
        self,
        cached: _Built | None,
        version: int,
        labels: Mapping[str, str],
        bounds: SpecBounds,
        pods_moved: bool,
    ) -> bool:
        if cached is None or cached[0] != version or cached[1] is not labels or cached[2] != bounds:
            return False
        # Another pod of the node may have changed: ours are checked, not rebuilt.
        return not pods_moved or all(self._pods.get(uid) is pod for uid, pod in cached[3].items())

    def check_pod(self, pod: PodInfo) -> list[EnforcementSpec]:
        """Specs of one pod's assigned containers, reporting new problems (after Allocate, and
        when the pod's annotations change)."""
        default = self.default_policy()
        out = [build_spec(item, pod, default, self._bounds()) for item in self._ledger.of_pod(pod.uid)]
        for spec in out:
            self._report(spec, pod)
        return out

    def forget(self, pod_uid: str) -> None:
        with self._lock:
            self._reported = {k for k in self._reported if k[0] != pod_uid}

    def _report(self, spec: EnforcementSpec, pod: PodInfo | None = None) -> None:
        said = [(INVALID_ANNOTATION, p) for p in spec.problems] + [
            (BOUNDED_ANNOTATION, b) for b in spec.bounded
        ]
        for reason, problem in said:
            if not self._first_time(spec.pod_uid, problem):
                continue
            message = (
                f"container {spec.container}: {problem}; enforcing {spec.policy} with a cap of {spec.cap}"
            )
            log.warning("pod %s: %s", f"{spec.namespace}/{spec.pod}", message)
            target = pod or self._pods.get(spec.pod_uid)
            if target is not None:
                self._events.pod(target, reason, message)

    def _first_time(self, owner: str, problem: str) -> bool:
        with self._lock:
            if (owner, problem) in self._reported:
                return False
            self._reported.add((owner, problem))
            return True
