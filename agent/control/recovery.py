"""kubelet is the truth about which pod holds which device IDs: its pod-resources API.

``verify`` (PreStartContainer) checks that the pod the ledger assumed for a set of IDs
is the one kubelet gave them to, and corrects the ledger if not. ``rebuild`` (agent
start) re-creates the ledger from pod-resources plus the pods' specs, so a restarted
agent agrees with kubelet without a private checkpoint; where pod-resources is not
served, the pods' own annotations (``predicate-gpu-idx-*``) are the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.control.annotator import Annotator
from agent.control.kubeports import DeviceRecord, DeviceTruth, PodSource
from agent.domain.annotations import GPU_ASSIGNED, predicate_key, predicated_gpus
from agent.domain.ids import UNITS_PER_GPU, IdTable
from agent.domain.ledger import Assignment, Ledger
from agent.domain.requests import resolve_ids
from agent.errors import KubeletError, VcudaError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, PodInfo

log = logging.getLogger(__name__)


@dataclass
class RebuildReport:
    source: str  # "pod-resources" or "annotations"
    restored: list[str] = field(default_factory=list)  # ns/pod/container
    problems: list[str] = field(default_factory=list)


class LedgerRecovery:
    def __init__(
        self,
        *,
        gpus: Sequence[GpuInfo],
        table: IdTable,
        ledger: Ledger,
        pods: PodSource,
        truth: DeviceTruth | None,
        annotator: Annotator,
        node_name: str,
        resource: str = CORE_RESOURCE,
    ) -> None:
        self._gpus = tuple(gpus)
        self._table = table
        self._ledger = ledger
        self._pods = pods
        self._truth = truth
        self._annotator = annotator
        self._node = node_name
        self._resource = resource
        self.corrections = 0
        self._warned = False

    # PreStartContainer --------------------------------------------------------
    def verify(self, device_ids: Sequence[str]) -> str:
        """'confirmed', 'corrected' or 'unverified' (kubelet could not tell)."""
        if self._truth is None or not device_ids:
            return "unverified"
        wanted = frozenset(device_ids)
        assumed = self._ledger.holder_of(device_ids[0])
        try:
            if assumed is not None:
                records = self._truth.get(assumed.namespace, assumed.pod)
                if records is not None and self._owner(records, wanted) == _who(assumed):
                    return "confirmed"
            owner = self._owner(self._truth.list(), wanted)
        except KubeletError as err:
            self._warn_once(f"cannot verify device IDs with kubelet's pod-resources API: {err}")
            return "unverified"
        if owner is None:
            log.warning("PreStartContainer: kubelet's pod-resources does not list %d IDs yet", len(wanted))
            return "unverified"
        if assumed is not None and _who(assumed) == owner:
            return "confirmed"
        self._correct(assumed, owner, wanted)
        return "corrected"

    def _owner(self, records: Sequence[DeviceRecord], wanted: frozenset[str]) -> tuple[str, str, str] | None:
        for r in records:
            if r.resource == self._resource and wanted <= frozenset(r.device_ids):
                return r.namespace, r.pod, r.container
        return None

    def _correct(self, assumed: Assignment | None, owner: tuple[str, str, str], ids: frozenset[str]) -> None:
        namespace, name, container = owner
        pod = self._pods.find(namespace, name)
        was = assumed.label if assumed else "nobody"
        self.corrections += 1
        log.warning(
            "ledger corrected: kubelet gave %d IDs to %s/%s/%s, not to %s",
            len(ids),
            namespace,
            name,
            container,
            was,
        )
        if assumed is not None:
            self._ledger.release(assumed.pod_uid, assumed.container)
            unassumed = self._pods.get(assumed.pod_uid)
            if unassumed is not None:
                self._annotator.submit(unassumed, {GPU_ASSIGNED: "false"})
        if pod is None:
            log.warning("pod %s/%s is not in the pod cache; its IDs stay unaccounted", namespace, name)
            return
        item = self._assignment(pod, container, sorted(ids))
        if item is None:
            return
        self._ledger.release(pod.uid, container)
        try:
            self._ledger.assign(item)
        except VcudaError as err:
            log.error("cannot record kubelet's allocation for %s: %s", item.label, err)
            return
        key = predicate_key(*_index(pod, container))
        self._annotator.submit(pod, {key: ",".join(map(str, item.gpus))})

    # Agent start --------------------------------------------------------------
    def rebuild(self) -> RebuildReport:
        """Replace the ledger with what kubelet (or, failing that, the annotations) says."""
        records: Sequence[DeviceRecord] | None = None
        if self._truth is not None:
            try:
                records = self._truth.list()
            except KubeletError as err:
                self._warn_once(f"pod-resources unavailable, rebuilding from pod annotations: {err}")
        report = RebuildReport("pod-resources" if records is not None else "annotations")
        items = self._from_records(records, report) if records is not None else self._from_annotations(report)
        report.problems += self._ledger.replace_all(items)
        report.restored = [i.label for i in items]
        log.info(
            "ledger rebuilt from %s: %d containers%s",
            report.source,
            len(items),
            f"; problems: {'; '.join(report.problems)}" if report.problems else "",
        )
        return report

    def _from_records(self, records: Sequence[DeviceRecord], report: RebuildReport) -> list[Assignment]:
        items: list[Assignment] = []
        for r in records:
            if r.resource != self._resource or not r.device_ids:
                continue
            pod = self._pods.find(r.namespace, r.pod)
            if pod is None:
                report.problems.append(f"{r.namespace}/{r.pod}/{r.container}: not in the pod cache (gone?)")
                continue
            item = self._assignment(pod, r.container, list(r.device_ids))
            if item is not None:
                items.append(item)
        return items

    def _from_annotations(self, report: RebuildReport) -> list[Assignment]:
        items: list[Assignment] = []
        for pod in self._pods.pods():
            if pod.node_name != self._node or pod.finished or pod.deleting:
                continue
            for c in pod.containers:
                gpus = predicated_gpus(pod.annotations, c.index, c.init) if c.wants_gpu else None
                if gpus is None or pod.annotations.get(GPU_ASSIGNED) != "true":
                    continue
                try:
                    cores, memory = c.quantity(CORE_RESOURCE), c.quantity(MEMORY_RESOURCE)
                except ValueError as err:
                    report.problems.append(f"{pod.key}/{c.name}: {err}")
                    continue
                whole = cores >= UNITS_PER_GPU
                items.append(
                    Assignment(
                        pod.uid, pod.namespace, pod.name, c.name, c.init, gpus, cores, 0 if whole else memory
                    )
                )
        return items

    # Helpers ---------------------------------------------------------------------
    def _assignment(self, pod: PodInfo, container: str, ids: list[str]) -> Assignment | None:
        spec = pod.container(container)
        if spec is None:
            log.error("kubelet reports IDs for %s/%s, a container the pod does not have", pod.key, container)
            return None
        try:
            resolved = resolve_ids(self._gpus, ids, self._table)
            memory = spec.quantity(MEMORY_RESOURCE)
        except (VcudaError, ValueError) as err:
            log.error("kubelet reports IDs for %s/%s that the agent cannot use: %s", pod.key, container, err)
            return None
        return Assignment(
            pod_uid=pod.uid,
            namespace=pod.namespace,
            pod=pod.name,
            container=container,
            init=spec.init,
            gpus=tuple(g.index for g in resolved.gpus),
            cores=resolved.cores,
            memory_mib=0 if resolved.whole else memory,
            device_ids=frozenset(ids),
        )

    def _find(self, namespace: str, name: str) -> PodInfo | None:
        return self._pods.find(namespace, name)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)


def _who(item: Assignment) -> tuple[str, str, str]:
    return item.namespace, item.pod, item.container


def _index(pod: PodInfo, container: str) -> tuple[int, bool]:
    spec = pod.container(container)
    assert spec is not None, "_assignment refused containers the pod does not have"
    return spec.index, spec.init
