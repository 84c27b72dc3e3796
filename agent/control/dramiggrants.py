"""What the MIG instances of prepared DRA claims mean for the rest of the node: the device
nodes their users may open (for the device guard and the pod gate, the same ``MigGrant`` a
device-plugin MIG device gives), the Events about a claim, and the periodic cleanup.

A claim's users are the containers whose ``resources.claims`` name a pod claim that resolves
to it (agent/control/draledger.py); each gets its claim's instances: the parent GPU's
``/dev/nvidia<minor>`` and exactly the instances' GPU-instance and compute-instance capability
minors. Events about a claim go to the pods that use it (waiting a moment for the pod watch to
bring one), or to the node when none comes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from agent.clock import Clock, SystemClock
from agent.control.draledger import users_by_claim
from agent.control.dramig import DynamicMig
from agent.control.kubeports import EventSink, PodSource
from agent.control.migholdings import MigGrant
from agent.domain.dra import ClaimRef, PreparedClaim
from agent.platform.kube.pods import PodInfo
from agent.settings import DRA_MIG_RECONCILE_S

log = logging.getLogger(__name__)


def mig_grants(claims: Sequence[PreparedClaim], pods: Sequence[PodInfo]) -> dict[tuple[str, str], MigGrant]:
    """(pod UID, container) -> the nodes its claims' MIG instances need."""
    users = users_by_claim(pods)
    found: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
    for claim in claims:
        if not claim.mig:
            continue
        for pod, container, _ in users.get((claim.ref.namespace, claim.ref.name), []):
            gpus, caps = found.setdefault((pod.uid, container), (set(), set()))
            for mig in claim.mig:
                gpus.add(mig.gpu_minor)
                caps.update(mig.cap_minors)
    return {key: MigGrant(frozenset(g), frozenset(c)) for key, (g, c) in found.items()}


def claim_pods(pods: Sequence[PodInfo], ref: ClaimRef) -> list[PodInfo]:
    """The pods on this node that use the claim."""
    return [p for p in pods if p.namespace == ref.namespace and ref.name in p.resource_claims.values()]


class ClaimMig:
    """The node-side view of the claims' MIG instances (module docstring)."""

    def __init__(
        self,
        mig: DynamicMig,
        claims: Callable[[], Sequence[PreparedClaim]],
        pods: PodSource | None = None,
        events: EventSink | None = None,
        *,
        period_s: float = DRA_MIG_RECONCILE_S,
        wait_for_pod_s: float = 3.0,
        clock: Clock | None = None,
    ) -> None:
        """``wait_for_pod_s``: how long an Event waits for the watch to deliver a pod that
        uses its claim (kubelet prepares a claim for a pod the watch may not have yet)."""
        self.mig = mig
        self._claims = claims
        self._pods = pods
        self._events = events
        self._period_s = period_s
        self._wait_for_pod_s = wait_for_pod_s
        self._clock = clock or SystemClock()

    def grants(self) -> Mapping[tuple[str, str], MigGrant]:
        if self._pods is None:
            return {}
        return mig_grants(self._claims(), self._pods.pods())

    def report(self, ref: ClaimRef, reason: str, message: str) -> None:
        """A Warning Event about the claim on the pods that use it (the node's when none comes)."""
        log.warning("%s: %s", reason, message)
        if self._events is None:
            return
        users: list[PodInfo] = []
        if self._pods is not None:
            pods = self._pods

            def found() -> bool:
                users[:] = claim_pods(pods.pods(), ref)
                return bool(users)

            pods.wait_for(found, self._wait_for_pod_s)
        for pod in users:
            self._events.pod(pod, reason, message)
        if not users:
            self._events.node(reason, message)

    def held(self) -> set[tuple[int, int]]:
        """(GPU, GI) of every instance a prepared claim holds."""
        return {(m.gpu_index, m.gi) for c in self._claims() for m in c.mig}

    def reconcile(self) -> None:
        self.mig.reconcile(self.held())

    def run(self, stop: threading.Event) -> None:
        """The cleanup and MIG mode, every ``period_s`` (the first pass is the caller's)."""
        while not self._clock.sleep(self._period_s, stop):
            self.reconcile()
