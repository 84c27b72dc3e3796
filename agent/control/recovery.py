"""kubelet is the truth about which pod holds which device IDs: its pod-resources API.

``verify`` (PreStartContainer) checks that the pod the ledger assumed for a set of IDs
is the one kubelet gave them to, and corrects the ledger if not. ``rebuild`` (agent
start) re-creates the ledger from pod-resources plus the pods' specs, so a restarted
agent agrees with kubelet without a private checkpoint; where pod-resources is not
served, the pods' own annotations (``predicate-gpu-idx-*``) are the fallback.

When kubelet does not answer (a timeout: kubelet busy or hung; its socket gone), nothing
waits on it: PreStartContainer goes ahead "unverified", and ``run`` re-checks those IDs every
``recheck_s`` until kubelet answers, then confirms or corrects them. After a first failure
PreStartContainer no longer asks kubelet itself (one slow call each would tie up the device
plugin's workers); the loop asks, and PreStartContainer asks again once kubelet has answered.
A rebuild that fell back to the annotations is checked against kubelet in the same way once
it answers: kubelet's records are confirmed or corrected, and entries restored from the
annotations that kubelet does not list are released. ``reannotate`` (agent start) writes
the annotations the ledger implies but the pods lack: a previous run's queued writes die
with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.control.annotator import Annotator
from agent.control.kubeports import DeviceRecord, DeviceTruth, PodSource
from agent.domain.annotations import GPU_ASSIGNED, predicated_gpus
from agent.domain.ids import UNITS_PER_GPU, IdTable
from agent.domain.ledger import Assignment, Ledger
from agent.domain.matching import placement_annotations
from agent.domain.requests import resolve_ids
from agent.errors import KubeletError, VcudaError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, PodInfo

log = logging.getLogger(__name__)

Owner = tuple[str, str, str]  # (namespace, pod, container) as kubelet's pod-resources names them


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
        recheck_s: float = 5.0,
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
        self._recheck_s = recheck_s
        self._lock = threading.Lock()  # guards the three below (PreStart threads and the loop)
        self._pending: dict[frozenset[str], list[str]] = {}  # IDs whose PreStart went unverified
        self._failing = 0  # calls to kubelet failed since it last answered
        self._failing_since = 0.0
        self._unchecked_rebuild = False  # the ledger came from the annotations: check it with kubelet

    # PreStartContainer --------------------------------------------------------
    def verify(self, device_ids: Sequence[str]) -> str:
        """'confirmed', 'corrected' or 'unverified' (kubelet could not tell, or did not answer:
        then ``run`` checks again later)."""
        return self.verify_owner(device_ids)[0]

    def verify_owner(self, device_ids: Sequence[str]) -> tuple[str, Owner | None]:
        """``verify``, plus the (namespace, pod, container) kubelet gave the IDs to (None when
        unverified)."""
        if self._truth is None or not device_ids:
            return "unverified", None
        with self._lock:
            if self._failing:  # kubelet is not answering: the loop asks it, PreStart goes ahead
                self._pending[frozenset(device_ids)] = list(device_ids)
                return "unverified", None
        return self._check(list(device_ids))

    def _check(self, device_ids: list[str]) -> tuple[str, Owner | None]:
        assert self._truth is not None
        wanted = frozenset(device_ids)
        assumed = self._ledger.holder_of(device_ids[0])
        try:
            if assumed is not None:
                records = self._truth.get(assumed.namespace, assumed.pod)
                if records is not None and self._owner(records, wanted) == _who(assumed):
                    self._answered(wanted)
                    return "confirmed", _who(assumed)
            owner = self._owner(self._truth.list(), wanted)
        except KubeletError as err:
            self._not_answered(err, device_ids)
            return "unverified", None
        self._answered(wanted)
        if owner is None:
            log.warning("PreStartContainer: kubelet's pod-resources does not list %d IDs yet", len(wanted))
            return "unverified", None
        return self._settle(assumed, owner, wanted), owner

    def _settle(self, assumed: Assignment | None, owner: tuple[str, str, str], ids: frozenset[str]) -> str:
        if assumed is not None and _who(assumed) == owner:
            return "confirmed"
        self._correct(assumed, owner, ids)
        return "corrected"

    def _owner(self, records: Sequence[DeviceRecord], wanted: frozenset[str]) -> Owner | None:
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
        self._annotator.submit(
            pod, placement_annotations(pod, self._ledger, [item], self._node, time.time_ns())
        )

    # Kubelet not answering --------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Re-check what kubelet could not confirm, every ``recheck_s`` (run it under the Supervisor)."""
        while not stop.wait(self._recheck_s):
            self.recheck()

    def recheck(self) -> None:
        """One pass: the unverified PreStarts, then a rebuild kubelet could not check at start.
        Stops at the first call kubelet does not answer (the next pass tries again)."""
        with self._lock:
            pending = list(self._pending.values())
        for ids in pending:
            if self._check(ids)[0] == "unverified" and self._failing:
                return
        if self._unchecked_rebuild:
            self._check_rebuild()

    def _not_answered(self, err: KubeletError, device_ids: list[str]) -> None:
        with self._lock:
            if device_ids:
                self._pending[frozenset(device_ids)] = device_ids
            self._failing += 1
            first = self._failing == 1
            if first:
                self._failing_since = time.monotonic()
        if first:
            log.warning(
                "kubelet's pod-resources API is not answering (%s); what it has not confirmed is "
                "re-checked every %.0f s until it answers, PreStartContainer goes ahead unverified meanwhile",
                err,
                self._recheck_s,
            )
        else:
            log.debug("kubelet's pod-resources API still not answering: %s", err)

    def _answered(self, ids: frozenset[str]) -> None:
        with self._lock:
            self._pending.pop(ids, None)
            failed, self._failing = self._failing, 0
            waiting = len(self._pending)
        if failed:
            log.info(
                "kubelet's pod-resources API answers again after %d failed calls over %.0f s; "
                "%d unverified PreStartContainer ID sets left to re-check",
                failed,
                time.monotonic() - self._failing_since,
                waiting,
            )

    def _check_rebuild(self) -> None:
        """kubelet answers now: its records confirm or correct the ledger; entries restored
        from annotations are replaced by kubelet's (with their IDs), or released when it does
        not list them (stale annotations)."""
        assert self._truth is not None
        try:
            records = [r for r in self._truth.list() if r.resource == self._resource and r.device_ids]
        except KubeletError as err:
            self._not_answered(err, [])
            return
        self._answered(frozenset())
        self._unchecked_rebuild = False
        for r in records:
            pod = self._pods.find(r.namespace, r.pod)
            restored = self._ledger.get(pod.uid, r.container) if pod is not None else None
            item = self._assignment(pod, r.container, list(r.device_ids)) if pod is not None else None
            if (
                restored is not None
                and not restored.device_ids
                and item is not None
                and item.gpus == restored.gpus
            ):
                self._ledger.release(restored.pod_uid, restored.container)  # the same, now with its IDs
                try:
                    self._ledger.assign(item)
                except VcudaError as err:
                    log.error("cannot record kubelet's allocation for %s: %s", item.label, err)
                continue
            owner = (r.namespace, r.pod, r.container)
            self._settle(self._ledger.holder_of(r.device_ids[0]), owner, frozenset(r.device_ids))
        listed = {(r.namespace, r.pod, r.container) for r in records}
        for item in self._ledger.assignments():
            if not item.device_ids and _who(item) not in listed:
                self._ledger.release(item.pod_uid, item.container)
                log.warning(
                    "released %s: restored from annotations, but kubelet does not list it", item.label
                )
        log.info("the ledger rebuilt from annotations is checked against kubelet's pod-resources now")

    def reannotate(self) -> int:
        """Write the annotations the ledger implies but its pods lack (the run that allocated
        them died, or gave up, before writing them); returns how many pods get a write."""
        now, written = time.time_ns(), 0
        for uid in sorted({item.pod_uid for item in self._ledger.assignments()}):
            pod = self._pods.get(uid)
            if pod is None or pod.finished or pod.deleting:
                continue
            updates = placement_annotations(pod, self._ledger, self._ledger.of_pod(uid), self._node, now)
            if updates:
                self._annotator.submit(pod, updates)
                written += 1
        if written:
            log.info("re-writing the annotations of %d pods that do not show what the ledger holds", written)
        return written

    # Agent start --------------------------------------------------------------
    def rebuild(self) -> RebuildReport:
        """Replace the ledger with what kubelet (or, failing that, the annotations) says."""
        records: Sequence[DeviceRecord] | None = None
        if self._truth is not None:
            try:
                records = self._truth.list()
            except KubeletError as err:
                self._not_answered(err, [])
                log.warning(
                    "rebuilding the ledger from pod annotations until kubelet's pod-resources answers"
                )
                self._unchecked_rebuild = True
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


def _who(item: Assignment) -> tuple[str, str, str]:
    return item.namespace, item.pod, item.container
