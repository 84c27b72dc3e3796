"""Which containers the device guard covers, and what each may open.

Every started container of every pod on this node is a target: a container in the
ledger may use its own GPUs' minors; every other container gets no NVIDIA device
(this closes NVIDIA_VISIBLE_DEVICES=all on pods that never asked for a GPU). Not
covered: the agent's own pod (NVML needs /dev/nvidia*), pods annotated
``nvidia.com/vcuda-device-guard: exempt`` in a namespace the admin listed
(``--guard-exempt-namespaces``, e.g. a DCGM exporter's), and pods that request GPUs from
another device plugin (``nvidia.com/gpu``, MIG resources). The annotation anywhere else is
refused, with an Event: a tenant cannot exempt itself (docs/security.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from agent.control.deviceguard import GuardTarget, TargetsNotReadyError
from agent.control.kubeports import EventSink
from agent.domain.ledger import Ledger
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.podcache import PodCache
from agent.platform.kube.pods import PodInfo

EXEMPT_ANNOTATION = "nvidia.com/vcuda-device-guard"
EXEMPT_VALUE = "exempt"
EXEMPTION_REFUSED = "DeviceGuardExemptionRefused"
_OTHER_GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-")

log = logging.getLogger(__name__)


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
    ) -> None:
        self._pods = pods
        self._ledger = ledger
        self._minors: Mapping[int, int] = {g.index: g.minor for g in gpus}
        self._own = own_pod_uid
        self._exempt_namespaces = exempt_namespaces
        self._events = events
        self._refused: set[str] = set()  # pod uids told once that their annotation does not count

    def __call__(self) -> list[GuardTarget]:
        """The targets now; raises TargetsNotReadyError while the pod cache has not synced, so
        the guard keeps its rules instead of taking them all back for an empty list."""
        if not self._pods.stats().synced:
            raise TargetsNotReadyError("the pod cache has not synced yet; device rules stay as they are")
        targets: list[GuardTarget] = []
        for pod in self._pods.pods():
            if pod.finished or self._exempt(pod):
                continue
            for container in pod.containers:
                if not container.container_id:
                    continue  # not started: no cgroup yet
                held = self._ledger.get(pod.uid, container.name)
                minors = frozenset(self._minors[g] for g in held.gpus) if held is not None else None
                targets.append(
                    GuardTarget(
                        pod_uid=pod.uid,
                        qos=pod.qos_class,
                        container_id=container.container_id,
                        gpu_minors=minors,
                        label=f"{pod.key}/{container.name}",
                    )
                )
        return targets

    def _exempt(self, pod: PodInfo) -> bool:
        if pod.uid == self._own:
            return True
        if pod.annotations.get(EXEMPT_ANNOTATION) == EXEMPT_VALUE:
            if pod.namespace in self._exempt_namespaces:
                return True
            self._refuse(pod)
        return any(r.startswith(_OTHER_GPU_RESOURCES) for c in pod.containers for r in c.resources)

    def _refuse(self, pod: PodInfo) -> None:
        if pod.uid in self._refused:
            return
        self._refused.add(pod.uid)
        message = (
            f"{EXEMPT_ANNOTATION}: {EXEMPT_VALUE} is not honoured in namespace {pod.namespace}: exemptions "
            "are for the namespaces the cluster admin lists (--guard-exempt-namespaces); the device "
            "guard applies"
        )
        log.warning("pod %s: %s", pod.key, message)
        if self._events is not None:
            self._events.pod(pod, EXEMPTION_REFUSED, message)
