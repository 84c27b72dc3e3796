"""The DRA kubelet plugin assembled: the prepared-claims store, the preparer and the endpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from agent.control.draclaims import PreparedClaims
from agent.domain.dra import ClaimShare
from agent.domain.health import HealthBoard
from agent.platform.gpu.inventory import GpuInfo
from agent.settings import DraSettings
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.endpoint import DraEndpointStatus, DraPluginEndpoint
from agent.surfaces.draplugin.migprepare import MigPrepare
from agent.surfaces.draplugin.preparer import ClaimPreparer, ClaimReader, MpsGrants


class DraKubeletPlugin:
    """``prepared`` is the hook for the ledger: ``prepared.prepared()`` and
    ``prepared.subscribe(listener)``. The store is loaded from the checkpoint here, so
    subscribers can read it before ``start()`` serves kubelet."""

    def __init__(
        self,
        settings: DraSettings,
        *,
        node_name: str,
        gpus: Sequence[GpuInfo],
        claims: ClaimReader,
        responses: ResponseBuilder,
        board: HealthBoard | None = None,
        mps: MpsGrants | None = None,
        default_policy: Callable[[], str] = lambda: "fixed-share",
        ceiling: Callable[[ClaimShare], int] | None = None,
        agent_dev_root: Path | None = None,
        dynamic_mig: MigPrepare | None = None,
    ) -> None:
        self.settings = settings
        self.prepared = PreparedClaims(settings.checkpoint_dir)
        self.preparer = ClaimPreparer(
            node_name=node_name,
            gpus=gpus,
            claims=claims,
            responses=responses,
            store=self.prepared,
            cdi_dir=settings.cdi_dir,
            board=board,
            mps=mps,
            default_policy=default_policy,
            ceiling=ceiling,
            agent_dev_root=agent_dev_root,
            dynamic_mig=dynamic_mig,
        )
        self.endpoint = DraPluginEndpoint(settings, self.preparer)

    def start(self) -> None:
        """Serve the DRA and registration sockets; KubeletError if they cannot be served."""
        self.endpoint.start()

    def stop(self) -> None:
        """Remove both sockets (kubelet deregisters the plugin); prepared claims stay recorded."""
        self.endpoint.stop()

    def status(self) -> DraEndpointStatus:
        return self.endpoint.status()
