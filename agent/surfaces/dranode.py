"""The node agent as the DRA driver gpu.vcuda.io (``run --dra``), built from the settings:
the ResourceSlice of the node's DRA GPUs, the kubelet plugin that prepares claims on them,
and the prepared claims kept in the allocation ledger, so that the controller, the memory
guard, metrics and status hold and show claims like device-plugin allocations.

Both entry paths can run on one node without counting a GPU twice: ``--dra-gpus`` hands some
GPUs (default all) to DRA; the device plugin offers only the others (their vcuda-core IDs and
their vcuda-memory), and the slice only these. The ledger sees both.

With dynamic MIG (node config ``mig.dynamic``, docs/dra.md), the slice also offers those
GPUs' MIG placements, prepare creates the instances, the start re-adopts the checkpointed
claims' instances and destroys the others, and the device guard allows each claim's users
exactly their instances (``mig_grants``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from agent.control.draledger import SOURCE, ClaimLedger
from agent.control.dramig import DynamicMig
from agent.control.dramiggrants import ClaimMig
from agent.control.drapublisher import SlicePublisher
from agent.control.migholdings import MigGrant
from agent.control.migwatch import MigWatch
from agent.control.mpssharing import MpsSharing
from agent.control.supervisor import Supervisor
from agent.domain.dra import DRIVER, ClaimShare, PreparedClaim
from agent.domain.health import HealthBoard
from agent.domain.ledger import Assignment
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.kube.nodes import NodeClient
from agent.platform.kube.resourceclaims import ResourceClaimClient
from agent.platform.kube.resourceslices import ResourceSliceClient
from agent.settings import DraSettings
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.migprepare import MigPrepare
from agent.surfaces.draplugin.plugin import DraKubeletPlugin
from agent.surfaces.kubenode import KubeIntegration

log = logging.getLogger(__name__)


def split_gpus(
    gpus: Sequence[GpuInfo], settings: DraSettings
) -> tuple[tuple[GpuInfo, ...], tuple[GpuInfo, ...]]:
    """(the device plugin's GPUs, DRA's GPUs)."""
    if not settings.enabled:
        return tuple(gpus), ()
    dra = tuple(g for g in gpus if settings.gpus is None or g.index in settings.gpus)
    return tuple(g for g in gpus if g not in dra), dra


class DraIntegration:
    def __init__(
        self,
        settings: DraSettings,
        *,
        node_name: str,
        gpus: Sequence[GpuInfo],
        board: HealthBoard,
        scaling: Callable[[], float],
        kube: KubeIntegration,
        responses: ResponseBuilder,
        sharing: MpsSharing,
        backend: GpuBackend | None = None,
        mig_watch: MigWatch | None = None,
        mig_dynamic: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        """``backend``, ``mig_watch``, ``mig_dynamic`` (the node config's ``mig.dynamic``):
        dynamic MIG; without a backend it is off."""
        self.gpus = tuple(gpus)
        self.mig: ClaimMig | None = None
        prepare_mig: MigPrepare | None = None
        if backend is not None:
            dynamic = DynamicMig(backend, gpus, mig_dynamic, mig_watch)
            self.mig = ClaimMig(
                dynamic, self._prepared, kube.pods, kube.events, wait_for_pod_s=kube.settings.wait_for_pod_s
            )
            prepare_mig = MigPrepare(dynamic, responses, responses.dev_root, self.mig.report)
        self.publisher = SlicePublisher(
            ResourceSliceClient(kube.api, node_name, DRIVER),
            gpus,
            board,
            scaling=scaling,
            node_name=node_name,
            node_uid=NodeClient(kube.api, node_name, settings.api_timeout_s).uid,  # the slice's owner
            dynamic=self.mig.mig.ready if self.mig is not None else None,
        )
        self.plugin = DraKubeletPlugin(
            settings,
            node_name=node_name,
            gpus=gpus,
            claims=ResourceClaimClient(kube.api, settings.api_timeout_s),
            responses=responses,
            board=board,
            mps=sharing,
            default_policy=lambda: kube.specbook.default_policy().value,
            ceiling=self._ceiling,
            dynamic_mig=prepare_mig,
        )
        self._kube = kube
        self.claims = ClaimLedger(kube.ledger, kube.pods, self.plugin.prepared)
        self.plugin.prepared.subscribe(self._on_prepared)

    def _ceiling(self, share: ClaimShare) -> int:
        """A claim's MPS thread percentage, from its ShareConfig bounded by the node config
        exactly as its enforcement spec will be."""
        item = Assignment(
            "", "", "", "", False, (share.gpu_index,), share.cores, share.memory_mib,
            policy=share.policy, limit=share.limit, source=SOURCE,
        )  # fmt: skip
        return self._kube.specbook.spec_for(item).ceiling or 100

    def _on_prepared(self, prepared: Sequence[PreparedClaim]) -> None:
        self.claims.poke()

    def start(self, supervisor: Supervisor) -> None:
        """After the ledger's rebuild: the prepared claims (from the checkpoint) join it first."""
        self.claims.sync()
        if self.mig is not None:
            self.mig.reconcile()  # the checkpointed claims' instances stay, the others go
            supervisor.spawn("dra-mig", self.mig.run)
        supervisor.spawn("dra-claims", self.claims.run)
        supervisor.spawn("dra-slice-publisher", self.publisher.run)
        self.plugin.start()
        log.info(
            "DRA driver %s: GPUs %s published, %d claims prepared",
            DRIVER,
            ",".join(str(g.index) for g in self.gpus) or "none",
            len(self.plugin.prepared.prepared()),
        )

    def _prepared(self) -> list[PreparedClaim]:
        return self.plugin.prepared.prepared()

    def mig_grants(self) -> Mapping[tuple[str, str], MigGrant]:
        """(pod UID, container) -> the device nodes of its claims' MIG instances."""
        return self.mig.grants() if self.mig is not None else {}

    def describe(self) -> str:
        """One line for ``vcuda-agent status``."""
        endpoint = self.plugin.status()
        stats = self.publisher.stats
        registered = (
            "registered" if endpoint.registered else f"not registered ({endpoint.last_error or 'waiting'})"
        )
        slice_state = f"slice generation {stats.generation}, devices: {stats.devices}"
        if stats.last_error:
            slice_state += f", last error: {stats.last_error}"
        return f"{registered}; prepared claims: {len(self.plugin.prepared.prepared())}; {slice_state}"

    def stop(self) -> None:
        self.plugin.stop()
