"""Prepared DRA claims in the allocation ledger, so that the controller, the memory guard,
metrics, status and dashboards hold and show them exactly like device-plugin allocations.

A claim's share is enforced on the containers that use it: those whose
``resources.claims`` name a pod claim that resolves to it (``spec.resourceClaims`` with
``resourceClaimName``, or ``status.resourceClaimStatuses`` for a claim made from a
template). Several containers (of one pod or of pods sharing the claim) split its cores and
MiB evenly, the remainder to the first: together they never hold more of the ledger than the
claim consumed. Every one of them is enforced: when a claim has fewer cores (or MiB) than
containers, those whose part is 0 are still capped at 1 core (1 MiB), while the ledger
charges them only their part (``Assignment.charge``), so the caps of such a claim's
containers add up to at most one core per container more than the claim (a stated limit: a
cap cannot be below 1 core). A claim prepared for a pod whose containers have not been seen yet waits until
the pod cache shows them. The claim's ShareConfig (policy, limit) travels with the entries;
the node's bounds apply to it as to annotations (a claim is tenant input too). A share that a
MIG instance serves (dynamic MIG) has no entry: the hardware holds it, and the device guard
allows its users that instance (agent/control/dramiggrants.py).

Entries are keyed (pod uid, container) like the device plugin's, with the claim's CDI
device IDs as their device IDs, so the PreStart and rebuild paths (which work on
``nvidia.com/vcuda-core`` records) never mistake them for their own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from agent.control.kubeports import PodSource
from agent.domain.dra import ClaimRef, ClaimShare, PreparedMig
from agent.domain.ledger import Assignment, Ledger
from agent.errors import VcudaError
from agent.platform.kube.pods import PodInfo

log = logging.getLogger(__name__)
SOURCE = "dra"


class PreparedClaimLike(Protocol):
    @property
    def ref(self) -> ClaimRef: ...

    @property
    def shares(self) -> Sequence[ClaimShare]: ...

    @property
    def mig(self) -> Sequence[PreparedMig]: ...


class PreparedClaimSource(Protocol):
    def prepared(self) -> Sequence[PreparedClaimLike]: ...


def claim_users(pod: PodInfo, claim: ClaimRef) -> list[tuple[str, bool]]:
    """(container, init) of ``pod`` that use ``claim``, in pod order."""
    if pod.namespace != claim.namespace:
        return []
    names = {name for name, target in pod.resource_claims.items() if target == claim.name}
    return [(c.name, c.init) for c in pod.containers if names & set(c.claims)]


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` as even as whole units allow, the remainder to the first ones."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def users_by_claim(pods: Sequence[PodInfo]) -> dict[tuple[str, str], list[tuple[PodInfo, str, bool]]]:
    """(namespace, ResourceClaim name) -> the (pod, container, init) that use it: one pass over
    the pods, so a sync costs pods + claims, not their product."""
    users: dict[tuple[str, str], list[tuple[PodInfo, str, bool]]] = {}
    for pod in pods:
        if not pod.resource_claims:
            continue
        for claim_name in set(pod.resource_claims.values()):
            ref = ClaimRef(pod.namespace, claim_name, "")
            for container, init in claim_users(pod, ref):
                users.setdefault((pod.namespace, claim_name), []).append((pod, container, init))
    return users


def claim_entries(claims: Sequence[PreparedClaimLike], pods: Sequence[PodInfo]) -> list[Assignment]:
    """The ledger entries the prepared ``claims`` imply, given the pods on the node."""
    entries: list[Assignment] = []
    by_claim = users_by_claim(pods)
    for claim in claims:
        users = by_claim.get((claim.ref.namespace, claim.ref.name), [])
        if not users:
            continue
        on_mig = {(m.request, m.device) for m in claim.mig}
        for share in claim.shares:
            if (share.request, share.device) in on_mig:
                continue
            cores = split(share.cores, len(users))
            memory = split(share.memory_mib, len(users))
            for (pod, container, init), c, m in zip(users, cores, memory, strict=True):
                # More users than cores (or MiB): a part of 0 would leave the container
                # unthrottled (0 MiB is "no quota"), so it is capped at the least there is.
                cap_cores, cap_mib = max(c, 1), (max(m, 1) if share.memory_mib else 0)
                entries.append(
                    Assignment(
                        pod_uid=pod.uid,
                        namespace=pod.namespace,
                        pod=pod.name,
                        container=container,
                        init=init,
                        gpus=(share.gpu_index,),
                        cores=cap_cores,
                        memory_mib=cap_mib,
                        device_ids=frozenset({f"{SOURCE}:{claim.ref.uid}:{share.request}"}),
                        policy=share.policy,
                        limit=share.limit,
                        source=SOURCE,
                        charge=None if (cap_cores, cap_mib) == (c, m) else (c, m),
                    )
                )
    return _merge(entries)


def _merge(entries: list[Assignment]) -> list[Assignment]:
    """One entry per container: a container using two claims on one GPU holds their sum."""
    merged: dict[tuple[str, str], Assignment] = {}
    for item in entries:
        held = merged.get(item.key)
        if held is None:
            merged[item.key] = item
        elif held.gpus == item.gpus:
            charge = None
            if held.charge is not None or item.charge is not None:
                a, b = _charge(held), _charge(item)
                charge = (min(100, a[0] + b[0]), a[1] + b[1])
            merged[item.key] = replace(
                held,
                cores=min(100, held.cores + item.cores),
                memory_mib=held.memory_mib + item.memory_mib,
                device_ids=held.device_ids | item.device_ids,
                charge=charge,
            )
        else:
            log.warning(
                "container %s uses claims on GPUs %s and %s: only the first is held (one GPU per share)",
                item.label,
                held.gpus,
                item.gpus,
            )
    return list(merged.values())


def _charge(item: Assignment) -> tuple[int, int]:
    return item.charge if item.charge is not None else (item.cores, item.memory_mib)


class ClaimLedger:
    """Keeps the ledger's DRA entries equal to what the prepared claims imply (``sync``)."""

    def __init__(self, ledger: Ledger, pods: PodSource, claims: PreparedClaimSource) -> None:
        self._ledger = ledger
        self._pods = pods
        self._claims = claims
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def poke(self) -> None:
        """Something changed (a claim prepared or unprepared): sync soon."""
        self._changed.set()

    def sync(self) -> int:
        """Assign, update and release DRA entries; returns how many changed."""
        with self._lock:
            wanted = {e.key: e for e in claim_entries(self._claims.prepared(), self._pods.pods())}
            held = {a.key: a for a in self._ledger.assignments() if a.source == SOURCE}
            changed = 0
            for key, item in held.items():
                if wanted.get(key) != item:
                    self._ledger.release(*key)
                    changed += 1
            for key, item in wanted.items():
                if held.get(key) == item:
                    continue
                try:
                    self._ledger.assign(item)
                except VcudaError as err:  # over capacity: the device plugin's shares are there too
                    log.error("cannot hold DRA claim share of %s: %s", item.label, err)
                    continue
                changed += 1
            return changed

    def run(self, stop: threading.Event, period_s: float = 1.0) -> None:
        """Sync on every poke and every ``period_s`` (the pod cache has no callback of its own)."""
        while not stop.is_set():
            self.sync()
            self._changed.wait(period_s)
            self._changed.clear()
