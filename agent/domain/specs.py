"""Enforcement specs: what [D]'s controller must hold each GPU container to.

One spec per container in the ledger. A share gets a cap (``vcuda-core-limit`` or its
request), a memory quota (its vcuda-memory request) and a policy (pod annotation >
node label > fixed-share). Whole GPUs are exclusive: no cap, no quota. An invalid
annotation never blocks the pod: it yields the safe default (fixed-share with the
request as a hard cap) and a problem message for a Kubernetes Event.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.domain.annotations import CORE_LIMIT, POLICY, Policy, parse_core_limit, parse_policy
from agent.domain.ledger import Assignment
from agent.platform.kube.pods import PodInfo


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


def build_spec(item: Assignment, pod: PodInfo | None, default: Policy) -> EnforcementSpec:
    """The spec for one ledger entry; ``pod`` None when the pod is not (yet) in the cache."""
    annotations = pod.annotations if pod is not None else {}
    container = pod.container(item.container) if pod is not None else None
    problems: list[str] = []
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
    )
