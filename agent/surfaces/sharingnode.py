"""The node's sharing mode and MPS daemons, built from the settings (issue K)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.control.mpssharing import MpsSharing
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.settings import SharingMode, SharingSettings
from agent.surfaces.kubenode import KubeIntegration


def build_sharing(
    settings: SharingSettings,
    *,
    backend: GpuBackend,
    gpus: Sequence[GpuInfo],
    node_mode: Callable[[], str | None],
    kube: KubeIntegration | None,
) -> MpsSharing:
    """``node_mode``: the node config's sharingMode (None: the agent's --sharing-mode), read
    at each Allocate so that a config reload applies to the next pod."""

    def mode() -> SharingMode:
        return SharingMode(node_mode() or settings.mode)

    command = list(settings.mps_control) or backend.mps_control_command()
    if kube is None:
        return MpsSharing(settings, gpus=gpus, command=command, mode=mode)

    def shares_on(index: int) -> int:
        return sum(1 for holder in kube.ledger.usage(index).holders if not holder.whole)

    return MpsSharing(
        settings,
        gpus=gpus,
        command=command,
        mode=mode,
        spec_for=kube.specbook.spec_for,
        shares_on=shares_on,
        live=kube.ledger.keys,
    )
