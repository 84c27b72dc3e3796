"""The node's sharing mode (freezer, mps, auto) and MPS daemons, built from the settings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from agent.control.mpssharing import MpsSharing
from agent.domain.annotations import Policy
from agent.domain.ledger import Assignment
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.kube.pods import PodInfo
from agent.platform.kube.podsecurity import NO_SPEC
from agent.platform.mpsdaemon import probe_command
from agent.platform.mpsv3 import MpsCapability, detect
from agent.settings import SharingMode, SharingSettings
from agent.surfaces.kubenode import KubeIntegration

log = logging.getLogger(__name__)


def build_sharing(
    settings: SharingSettings,
    *,
    backend: GpuBackend,
    gpus: Sequence[GpuInfo],
    node_mode: Callable[[], str | None],
    kube: KubeIntegration | None,
    node_advisory: Callable[[], bool | None] = lambda: None,
) -> MpsSharing:
    """``node_mode``, ``node_advisory``: the node config's sharingMode and mpsAdvisoryLimits
    (None: the agent's flags), read at each Allocate so that a config reload applies to the
    next pod."""

    def mode() -> SharingMode:
        return SharingMode(node_mode() or settings.mode)

    def advisory_allowed() -> bool:
        said = node_advisory()
        return settings.advisory_limits if said is None else said

    command = list(settings.mps_control) or backend.mps_control_command()
    capability = mps_capability(command, gpus, wanted=mode() is not SharingMode.FREEZER)
    if kube is None:
        return MpsSharing(
            settings,
            gpus=gpus,
            command=command,
            mode=mode,
            advisory_allowed=advisory_allowed,
            capability=capability,
        )

    def shares_on(index: int) -> int:
        return sum(1 for holder in kube.ledger.usage(index).holders if not holder.whole)

    def fixed_on(index: int, assignment: Assignment | None) -> int:
        total = 0
        for holder in kube.ledger.usage(index).holders:
            if holder.whole or (assignment is not None and holder.key == assignment.key):
                continue
            spec = kube.specbook.spec_for(holder)
            if spec.policy is Policy.FIXED_SHARE and spec.cap is not None:
                total += spec.cap
        return total

    return MpsSharing(
        settings,
        gpus=gpus,
        command=command,
        mode=mode,
        spec_for=kube.specbook.spec_for,
        shares_on=shares_on,
        fixed_on=fixed_on,
        live=kube.ledger.keys,
        advisory_allowed=advisory_allowed,
        capability=capability,
        root_risk=lambda a: container_root_risk(kube.pods.get(a.pod_uid), a.container),
    )


def container_root_risk(pod: PodInfo | None, container: str) -> str | None:
    """Why a container's pod spec does not prove it cannot run as root (None: proven)."""
    found = None if pod is None else pod.container(container)
    return NO_SPEC if found is None else found.root_risk


def mps_capability(command: list[str], gpus: Sequence[GpuInfo], *, wanted: bool) -> MpsCapability | None:
    """MPS v3 and dmem on this node, probed once at start where MPS may be used (None: not
    probed; a node config that turns MPS on later gets protocol 2's advisory limits)."""
    if not wanted or probe_command(command) is not None:
        return None
    capability = detect(command, {g.index: g.pci_bus_id for g in gpus})
    log.info("%s", capability.describe())
    return capability
