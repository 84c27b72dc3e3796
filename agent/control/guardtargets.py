"""Which containers the device guard covers, and what each may open.

Every started container of every pod on this node is a target: a container in the
ledger may use its own GPUs' minors, one holding MIG devices of this agent's MIG plugins
their parent GPUs and exactly their capability nodes (``control/migholdings.py``); every
other container gets no NVIDIA device
(this closes NVIDIA_VISIBLE_DEVICES=all on pods that never asked for a GPU). Not
covered: the agent's own pod (NVML needs /dev/nvidia*), pods annotated
``nvidia.com/vcuda-device-guard: exempt`` in a namespace the admin listed
(``--guard-exempt-namespaces``, e.g. a DCGM exporter's), and pods that request a quantity
above zero of a GPU resource another device plugin offers on this node (``nvidia.com/gpu``,
MIG resources, read from the Node's allocatable and capacity; not those this agent serves
itself). The annotation anywhere else,
a zero quantity (it passes the scheduler's fit check on any node) and a resource this node
does not offer are refused, with an Event: a tenant cannot exempt itself (docs/security.md).
Why each pod is exempt is kept for the status document (``exemptions``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.control.deviceguard import GuardTarget, TargetsNotReadyError
from agent.control.kubeports import EventSink
from agent.control.migholdings import MigGrant
from agent.domain.ledger import Ledger
from agent.platform.cgroups.devicepolicy import DevicePolicy
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.podcache import PodCache
from agent.platform.kube.pods import PodInfo, int_quantity

EXEMPT_ANNOTATION = "nvidia.com/vcuda-device-guard"
EXEMPT_VALUE = "exempt"
EXEMPTION_REFUSED = "DeviceGuardExemptionRefused"
_OTHER_GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-")

log = logging.getLogger(__name__)

# The Node's status.capacity merged with status.allocatable (resource → quantity text);
# None while the node has not been seen.
NodeResources = Callable[[], Mapping[str, str] | None]


@dataclass(frozen=True)
class Exemption:
    """A pod the guard leaves alone, and why (for ``vcuda-agent status``)."""

    namespace: str
    pod: str
    reason: str


def offered_gpu_resources(resources: Mapping[str, str]) -> frozenset[str]:
    """The other plugins' GPU resources this node offers: a quantity above zero."""
    offered = set()
    for name, text in resources.items():
        if not name.startswith(_OTHER_GPU_RESOURCES):
            continue
        try:
            if int_quantity(str(text)) > 0:
                offered.add(name)
        except ValueError:
            continue  # not a whole number: nothing a pod can be granted
    return frozenset(offered)


class GuardTargets:
    def __init__(
        self,
        pods: PodCache,
        ledger: Ledger,
        gpus: Sequence[GpuInfo],
        own_pod_uid: str = "",
        *,
        exempt_namespaces: frozenset[str] = frozenset(),
        events: EventSink | None = None,
        node_resources: NodeResources | None = None,
        mig: Callable[[], Mapping[tuple[str, str], MigGrant]] | None = None,
        own_resources: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        """``node_resources``: this Node's resources; without it no pod is exempt for another
        plugin's GPUs (the guard fails closed). ``mig``: (pod UID, container) -> the nodes its
        MIG devices need; ``own_resources``: the GPU resources this agent serves (MIG ones),
        which exempt no pod."""
        self._pods = pods
        self._ledger = ledger
        self._minors: Mapping[int, int] = {g.index: g.minor for g in gpus}
        self._own = own_pod_uid
        self._exempt_namespaces = exempt_namespaces
        self._events = events
        self._node_resources = node_resources
        self._mig = mig or dict
        self._own_resources = own_resources
        self._refused: set[tuple[str, str]] = set()  # (pod uid, what) told once that it does not count
        self._exemptions: dict[str, Exemption] = {}  # pod uid → why, as of the last call

    def __call__(self) -> list[GuardTarget]:
        """The targets now; raises TargetsNotReadyError while the pod cache has not synced, so
        the guard keeps its rules instead of taking them all back for an empty list."""
        if not self._pods.stats().synced:
            raise TargetsNotReadyError("the pod cache has not synced yet; device rules stay as they are")
        offered = self._offered()
        grants = self._mig()
        targets: list[GuardTarget] = []
        exemptions: dict[str, Exemption] = {}
        for pod in self._pods.pods():
            if pod.finished:
                continue
            reason = self._exempt(pod, offered)
            if reason is not None:
                exemptions[pod.uid] = Exemption(pod.namespace, pod.name, reason)
                continue
            for container in pod.containers:
                if not container.container_id:
                    continue  # not started: no cgroup yet
                held = self._ledger.get(pod.uid, container.name)
                minors = frozenset(self._minors[g] for g in held.gpus) if held is not None else None
                grant = grants.get((pod.uid, container.name))
                if grant is not None:
                    minors = (minors or frozenset()) | grant.gpu_minors
                targets.append(
                    GuardTarget(
                        pod_uid=pod.uid,
                        qos=pod.qos_class,
                        container_id=container.container_id,
                        gpu_minors=minors,
                        label=f"{pod.key}/{container.name}",
                        cap_minors=grant.cap_minors if grant is not None else frozenset(),
                    )
                )
        self._exemptions = exemptions
        return targets

    def add_mig(
        self, grants: Callable[[], Mapping[tuple[str, str], MigGrant]], own: Callable[[], frozenset[str]]
    ) -> None:
        """The MIG holdings and the MIG resources this agent serves (the ``mig`` and
        ``own_resources`` of the constructor)."""
        self._mig, self._own_resources = grants, own

    def add_mig_source(self, grants: Callable[[], Mapping[tuple[str, str], MigGrant]]) -> None:
        """More MIG holdings (the DRA claims' MIG instances): a container holding devices of
        both is allowed the nodes of both."""
        first = self._mig

        def merged() -> Mapping[tuple[str, str], MigGrant]:
            found = dict(first())
            for key, grant in grants().items():
                held = found.get(key)
                found[key] = (
                    grant
                    if held is None
                    else MigGrant(held.gpu_minors | grant.gpu_minors, held.cap_minors | grant.cap_minors)
                )
            return found

        self._mig = merged

    def exemptions(self) -> list[Exemption]:
        """The pods left alone as of the last pass, and why."""
        return sorted(self._exemptions.values(), key=lambda e: (e.namespace, e.pod))

    def _offered(self) -> frozenset[str]:
        if self._node_resources is None:
            return frozenset()
        resources = self._node_resources()
        if resources is None:
            raise TargetsNotReadyError("the node has not been seen yet; device rules stay as they are")
        return offered_gpu_resources(resources) - self._own_resources()

    def pod_policy(self, uid: str) -> DevicePolicy | None:
        """What a pod's cgroup may open, for the device gate: the GPUs the ledger holds for any
        of its containers, no NVIDIA device without any; None when the pod is exempt. A pod the
        cache does not know (yet) is held to what the ledger says: Allocate knew its UID. So
        is every pod before the pod cache has synced or the Node has been seen: the gate
        closes from the agent's first instant, and an exempt pod is released once the
        exemption can be checked (:meth:`settled`)."""
        if uid == self._own:
            return None
        pod = self._pods.get(uid)
        if pod is not None:
            offered = self._offered_or_none()
            if self._exempt(pod, offered) is not None:
                return None
        held = self._ledger.of_pod(uid)
        grants = [g for (pod_uid, _), g in self._mig().items() if pod_uid == uid]
        if not held and not grants:
            return DevicePolicy(None)
        minors = frozenset(self._minors[g] for a in held for g in a.gpus)
        minors |= frozenset(m for g in grants for m in g.gpu_minors)
        return DevicePolicy(minors, frozenset(m for g in grants for m in g.cap_minors))

    def settled(self) -> bool:
        """Whether a pod's exemption can be decided now (the pod cache has synced and the Node
        has been seen): before, :meth:`pod_policy` fails closed."""
        return self._pods.stats().synced and self._offered_or_none() is not None

    def _offered_or_none(self) -> frozenset[str] | None:
        try:
            return self._offered()
        except TargetsNotReadyError:
            return None

    def _exempt(self, pod: PodInfo, offered: frozenset[str] | None) -> str | None:
        """Why the pod is exempt, or None. ``offered`` None: the Node has not been seen, so
        no pod is exempt for another plugin's GPUs yet (and nothing is refused for it)."""
        if pod.uid == self._own:
            return "the agent's own pod (NVML needs every GPU)"
        if pod.annotations.get(EXEMPT_ANNOTATION) == EXEMPT_VALUE:
            annotation = f"{EXEMPT_ANNOTATION}: {EXEMPT_VALUE}"
            if pod.namespace in self._exempt_namespaces:
                return f"{annotation} in namespace {pod.namespace} (--guard-exempt-namespaces)"
            self._refuse(
                pod,
                "annotation",
                f"{annotation} is not honoured in namespace {pod.namespace}: exemptions are for the "
                "namespaces the cluster admin lists (--guard-exempt-namespaces); the device guard applies",
            )
        named: list[str] = []
        own = self._own_resources()
        for c in pod.containers:
            for resource, text in c.resources.items():
                if not resource.startswith(_OTHER_GPU_RESOURCES) or resource in own:
                    continue
                try:
                    amount = int_quantity(text)
                except ValueError:
                    amount = 0
                if offered is not None and amount > 0 and resource in offered:
                    return f"{resource}: {text} (container {c.name}) from another device plugin"
                named.append(f"{resource}: {text!r}")
        if named and offered is not None:
            self._refuse(
                pod,
                "resource",
                f"{', '.join(sorted(set(named)))} does not exempt the pod from the device guard: only a "
                "quantity above zero of a GPU resource this node offers does; the device guard applies",
            )
        return None

    def _refuse(self, pod: PodInfo, what: str, message: str) -> None:
        if (pod.uid, what) in self._refused:
            return
        self._refused.add((pod.uid, what))
        log.warning("pod %s: %s", pod.key, message)
        if self._events is not None:
            self._events.pod(pod, EXEMPTION_REFUSED, message)
