"""The node agent's Kubernetes side, built from the settings: pod cache, node publisher,
events, the allocation ledger with Allocate ↔ pod matching, recovery from kubelet's
pod-resources, and the enforcement specs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from agent.control.allocations import Allocations
from agent.control.annotator import Annotator
from agent.control.nodepublisher import MigSource, NodePublisher
from agent.control.recovery import LedgerRecovery, RebuildReport
from agent.control.specbook import SpecBook
from agent.control.supervisor import Supervisor
from agent.domain.health import HealthBoard
from agent.domain.ledger import Ledger
from agent.domain.placement import Placer
from agent.domain.specs import EnforcementSpec, SpecBounds
from agent.errors import VcudaError
from agent.platform.gpu.inventory import GpuInfo, Topology
from agent.platform.kube.client import api_client
from agent.platform.kube.events import EventRecorder
from agent.platform.kube.nodes import NodeClient, NodeWatch, offered_resources
from agent.platform.kube.podcache import PodCache
from agent.platform.kube.pods import PodInfo
from agent.platform.kube.podwriter import PodWriter
from agent.platform.kubelet.podresources import PodResourcesClient
from agent.settings import KubeSettings

log = logging.getLogger(__name__)


class KubeIntegration:
    def __init__(
        self,
        *,
        settings: KubeSettings,
        node_name: str,
        gpus: Sequence[GpuInfo],
        topology: Topology,
        board: HealthBoard,
        placer: Placer,
        scaling: Callable[[], float],
        bounds: Callable[[], SpecBounds] = SpecBounds,
        plugin_gpus: Sequence[GpuInfo] | None = None,
        mig: MigSource | None = None,
        withheld: Callable[[], Collection[int]] = frozenset,
        mig_strategy: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``plugin_gpus``: the GPUs the device plugin offers (default all), which the node's
        vcuda-memory and the extender's inventory describe; the ledger holds every GPU.
        ``mig``: the GPUs' MIG state, for the annotation and the MIG labels; ``withheld``: the
        GPUs that offer no shares (in MIG mode); ``mig_strategy``: for the MIG strategy label."""
        self.settings = settings
        self.node_name = node_name
        api = self.api = api_client(settings.kubeconfig, in_cluster=settings.kubeconfig is None)
        self.pods = PodCache(api, node_name)
        self.events = EventRecorder(api, node_name)
        self.annotator = Annotator(PodWriter(api))
        self.node_watch = NodeWatch(api, node_name)
        self.publisher = NodePublisher(
            NodeClient(api, node_name),
            self.node_watch,
            gpus if plugin_gpus is None else plugin_gpus,
            topology,
            board,
            scaling=scaling,
            node_name=node_name,
            check_interval_s=settings.capacity_check_s,
            heartbeat_s=settings.heartbeat_s,
            mig=mig,
            withheld=withheld,
            mig_strategy=mig_strategy,
        )
        self.ledger = Ledger(gpus, scaling)
        self.truth = PodResourcesClient(settings.pod_resources_socket)
        self.allocations = Allocations(
            node_name=node_name,
            table=placer.table,
            placer=placer,
            ledger=self.ledger,
            pods=self.pods,
            annotator=self.annotator,
            events=self.events,
            wait_for_pod_s=settings.wait_for_pod_s,
        )
        self.recovery = LedgerRecovery(
            gpus=gpus,
            table=placer.table,
            ledger=self.ledger,
            pods=self.pods,
            truth=self.truth,
            annotator=self.annotator,
            node_name=node_name,
            recheck_s=settings.recheck_s,
        )
        self.specbook = SpecBook(
            self.ledger, self.pods, self.events, node_name, self.node_labels, bounds=bounds
        )
        self.allocations.on_assigned.append(self.specbook.check_pod)
        self.pods.subscribe(self._on_pod_event)
        self.last_rebuild: RebuildReport | None = None
        self._labels: Mapping[str, str] = {}
        self._labels_version = -1
        self._resources: Mapping[str, str] | None = None
        self._resources_version = -1

    def node_labels(self) -> Mapping[str, str]:
        """The node's labels, re-read only when the node watch saw a change (Allocate asks)."""
        version = self.node_watch.version
        if version != self._labels_version:
            node: Mapping[str, Any] = self.node_watch.current() or {}
            labels = (node.get("metadata") or {}).get("labels") or {}
            self._labels = {str(k): str(v) for k, v in labels.items()}
            self._labels_version = version
        return self._labels

    def node_resources(self) -> Mapping[str, str] | None:
        """The node's status.capacity with status.allocatable over it (what it offers), re-read
        only when the node watch saw a change; None until the node has been seen."""
        version = self.node_watch.version
        if version != self._resources_version:
            self._resources = offered_resources(self.node_watch.current())
            self._resources_version = version
        return self._resources

    def specs(self) -> list[EnforcementSpec]:
        return self.specbook.specs()

    def _on_pod_event(self, kind: str, old: PodInfo | None, new: PodInfo | None) -> None:
        self.allocations.on_pod_event(kind, old, new)
        if kind == "DELETED" and old is not None:
            self.specbook.forget(old.uid)
        elif new is not None and self.ledger.of_pod(new.uid):
            self.specbook.check_pod(new)

    def start(self, supervisor: Supervisor) -> None:
        """Start the loops, wait for the first pod list, then rebuild the ledger from kubelet:
        the device plugin must not answer Allocate before that."""
        supervisor.spawn("pod-cache", self.pods.run)
        supervisor.spawn("node-watch", self.node_watch.run)
        supervisor.spawn("events", self.events.run)
        supervisor.spawn("annotator", self.annotator.run)
        supervisor.spawn("node-publisher", self.publisher.run)
        if not self.pods.wait_synced(self.settings.sync_timeout_s):
            log.warning(
                "no pod list from the API server within %.0f s; continuing, the ledger may be incomplete "
                "until the watch catches up",
                self.settings.sync_timeout_s,
            )
        try:
            self.last_rebuild = self.recovery.rebuild()
        except VcudaError as err:
            log.error("cannot rebuild the ledger at start: %s", err)
        self.recovery.reannotate()  # writes a killed run still owed its pods
        supervisor.spawn("pod-resources-recheck", self.recovery.run)

    def stop(self) -> None:
        self.annotator.flush(2.0)
        self.events.flush(2.0)
        self.truth.close()
