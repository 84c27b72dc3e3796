"""Enforcement specs: what the compute-cap loop and the memory guard must hold each GPU
container to.

One spec per container in the ledger. A share gets a cap (``vcuda-core-limit`` or its
request), a memory quota (its vcuda-memory request) and a policy (pod annotation >
node label > fixed-share). Whole GPUs are exclusive: no cap, no quota. An invalid
annotation never blocks the pod: it yields the safe default (fixed-share with the
request as a hard cap) and a problem message for a Kubernetes Event. What a pod may choose
is bounded by the cluster admin (``SpecBounds``, from the node config), not by the pod:
a policy the node does not allow becomes the node default, and a fixed-share cap above
``max_limit_ratio`` times the request becomes that bound; each with a message for an Event.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from agent.domain.annotations import CORE_LIMIT, POLICY, Policy, parse_core_limit, parse_policy
from agent.domain.ledger import Assignment
from agent.domain.nodeconfig import SAFE_POLICIES, NodeConfig
from agent.platform.kube.pods import PodInfo


@dataclass(frozen=True)
class SpecBounds:
    """What the admin lets a pod's own annotations choose (docs/security.md)."""

    allowed: frozenset[Policy] = field(default_factory=lambda: frozenset(Policy(p) for p in SAFE_POLICIES))
    max_limit_ratio: float = 1.0  # a fixed-share cap is at most the request x this

    @classmethod
    def of(cls, node: NodeConfig) -> SpecBounds:
        return _bounds_of(node.allowed_policies, node.max_limit_ratio)


@functools.lru_cache(maxsize=16)
def _bounds_of(allowed: tuple[str, ...], ratio: float) -> SpecBounds:
    # Asked at every control period and scrape; the node config changes at most on a reload.
    return SpecBounds(frozenset(Policy(p) for p in allowed), ratio)


@dataclass(frozen=True)
class EnforcementSpec:
    pod_uid: str
    namespace: str
    pod: str
    container: str
    container_id: str  # "" until the container started
    runtime: str  # containerID scheme: containerd, cri-o, docker ("" until started)
    qos_class: str
    gpus: tuple[int, ...]
    cores: int  # requested vcuda-core
    cap: int | None  # percent of one GPU; None for whole GPUs (never throttled)
    memory_quota_mib: int | None  # None for whole GPUs
    policy: Policy
    problems: tuple[str, ...] = ()  # invalid annotations replaced by the safe default
    limit_set: bool = False  # vcuda-core-limit was given (and valid)
    bounded: tuple[str, ...] = ()  # valid annotations the node's bounds cut back, and how

    @property
    def whole(self) -> bool:
        return self.cap is None

    @property
    def ceiling(self) -> int | None:
        """The most it may ever use: the cap, except that burst-share without a
        vcuda-core-limit may burst to the whole GPU. None: never throttled."""
        if self.cap is None or self.policy is Policy.BEST_EFFORT:
            return None
        if self.policy is Policy.BURST_SHARE and not self.limit_set:
            return 100
        return self.cap

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def node_policy(label: str | None, node_name: str) -> tuple[Policy, str]:
    """The node default from the node label; (fixed-share, problem) when it is invalid."""
    return parse_policy(label, Policy.FIXED_SHARE, f"node {node_name} label")


def build_spec(
    item: Assignment, pod: PodInfo | None, default: Policy, bounds: SpecBounds | None = None
) -> EnforcementSpec:
    """The spec for one ledger entry; ``pod`` None when the pod is not (yet) in the cache.
    A DRA claim's ShareConfig stands in for the annotations: the same parsing and bounds."""
    annotations = pod.annotations if pod is not None else {}
    if item.source == "dra":
        annotations = {
            key: value
            for key, value in (
                (POLICY, item.policy),
                (CORE_LIMIT, None if item.limit is None else str(item.limit)),
            )
            if value is not None
        }
    container = pod.container(item.container) if pod is not None else None
    problems: list[str] = []
    bounded: list[str] = []
    limit_set = False
    if item.whole:
        cap: int | None = None
        quota: int | None = None
        policy = default  # recorded, but a whole GPU is never throttled
    else:
        cap, limit_problem = parse_core_limit(annotations.get(CORE_LIMIT), item.cores)
        policy, policy_problem = parse_policy(annotations.get(POLICY), default, "pod annotation")
        problems = [p for p in (limit_problem, policy_problem) if p]
        if problems:
            cap, policy = item.cores, Policy.FIXED_SHARE  # the safe default
        limit_set = not problems and annotations.get(CORE_LIMIT) is not None
        policy, cap = _bound(
            policy, cap, item.cores, default=default, bounds=bounds or SpecBounds(), said=bounded
        )
        quota = item.memory_mib
    return EnforcementSpec(
        pod_uid=item.pod_uid,
        namespace=item.namespace,
        pod=item.pod,
        container=item.container,
        container_id=container.container_id if container else "",
        runtime=container.runtime if container else "",
        qos_class=pod.qos_class if pod is not None else "",
        gpus=item.gpus,
        cores=item.cores,
        cap=cap,
        memory_quota_mib=quota,
        policy=policy,
        problems=tuple(problems),
        limit_set=limit_set,
        bounded=tuple(bounded),
    )


def _bound(
    policy: Policy, cap: int, request: int, *, default: Policy, bounds: SpecBounds, said: list[str]
) -> tuple[Policy, int]:
    """The policy and cap within the node's bounds; what was cut back goes to ``said``."""
    if policy not in bounds.allowed and policy is not default:
        allowed = ", ".join(sorted(p.value for p in bounds.allowed))
        fallback = default if default in bounds.allowed else Policy.FIXED_SHARE
        said.append(
            f"{POLICY}={policy} is not allowed on this node (allowed: {allowed}); enforcing {fallback}"
        )
        policy = fallback
    if policy is Policy.FIXED_SHARE:
        most = max(request, math.floor(request * bounds.max_limit_ratio + 1e-9))
        if cap > most:
            said.append(
                f"{CORE_LIMIT}={cap} is more than this node allows for a request of {request} "
                f"(at most {bounds.max_limit_ratio:g} x the request); capping at {most}"
            )
            cap = most
    return policy, cap
