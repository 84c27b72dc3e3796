"""The MIG side of NodePrepareResources / NodeUnprepareResources (dynamic MIG).

Which shares a MIG instance serves, decided per allocated device:

- a **placement device** (``gpu-0-mig-3g40gb-4``): that profile at exactly that placement;
- a **share on a GPU on dynamic MIG** (its ``gpu-<index>`` device): the smallest profile that
  covers its consumed cores and memory (agent/domain/migfit.py), wherever it fits;
- a **share whose ShareConfig says** ``isolation: mig`` on any other GPU: refused, as no MIG
  instance can be made there.

The container gets what a device-plugin container of that MIG device gets (``build_mig``:
``NVIDIA_VISIBLE_DEVICES=MIG-<uuid>`` with nvidiactl, UVM, the parent GPU's node and the
instance's two capability nodes, or the CDI name of the MIG device), plus /dev/nvidia-modeset
where the host has it. Every failure is posted as an Event on the pods using the claim (or the
node, while none is known), besides the error kubelet gets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from agent.control.dramig import DynamicMig, DynamicMigError
from agent.domain.dra import ISOLATION_MIG, ClaimRef, ClaimShare, PreparedMig, mig_slot
from agent.domain.migoffer import OfferedDevice
from agent.domain.migpartition import slot_of
from agent.platform.cdi import ContainerEdits, DeviceNode, Mount, env_list
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migstate import MigDevice
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.surfaces.deviceplugin.responses import ResponseBuilder

log = logging.getLogger(__name__)

MODESET = "/dev/nvidia-modeset"
PREPARE_FAILED = "MIGPrepareFailed"
UNPREPARE_FAILED = "MIGUnprepareFailed"
Report = Callable[[ClaimRef, str, str], None]  # (claim, event reason, message)


def response_edits(
    response: pb.ContainerAllocateResponse, responses: ResponseBuilder, agent_dev_root: Path
) -> ContainerEdits:
    """A device plugin's ContainerAllocateResponse as CDI container edits (+ nvidia-modeset)."""
    nodes = [DeviceNode(d.container_path, d.host_path, d.permissions or "rw") for d in response.devices]
    if nodes and (agent_dev_root / MODESET.lstrip("/")).exists():
        nodes.append(DeviceNode(MODESET, str(responses.dev_root / MODESET.lstrip("/")), "rw"))
    mounts = tuple(Mount(m.container_path, m.host_path, m.read_only) for m in response.mounts)
    return ContainerEdits(env_list(dict(response.envs)), tuple(nodes), mounts)


def wants_mig(share: ClaimShare, dynamic: frozenset[int]) -> bool:
    """Whether a MIG instance must serve ``share`` (or refuse it)."""
    return (
        mig_slot(share.device) is not None or share.gpu_index in dynamic or share.isolation == ISOLATION_MIG
    )


class MigPrepare:
    def __init__(
        self,
        mig: DynamicMig,
        responses: ResponseBuilder,
        agent_dev_root: Path,
        report: Report | None = None,
    ) -> None:
        self.mig = mig
        self._responses = responses
        self._agent_dev_root = agent_dev_root
        self._report = report

    def wants(self, share: ClaimShare) -> bool:
        return wants_mig(share, self.mig.gpus())

    def create(self, ref: ClaimRef, share: ClaimShare) -> tuple[PreparedMig, MigDevice]:
        """The instance that serves ``share``; DynamicMigError (reported) when none can."""
        try:
            device = self._create(share)
        except DynamicMigError as err:
            self.report(ref, PREPARE_FAILED, f"claim {ref.key}: {share.device}: {err}")
            raise DynamicMigError(f"claim {ref.key}: {share.device}: {err}") from err
        gpu = self.mig.gpu(share.gpu_index)
        prepared = PreparedMig(
            request=share.request,
            device=share.device,
            gpu_index=gpu.index,
            gpu_minor=gpu.minor,
            gi=device.gi,
            ci=device.ci,
            uuid=device.uuid,
            profile=device.gi_profile,
            start=device.placement_start,
            size=device.placement_size,
            cap_minors=tuple(m for m in (device.gi_cap_minor, device.ci_cap_minor) if m is not None),
        )
        where = f"{device.placement_start}:{device.placement_size}"
        log.info("claim %s: %s served by MIG %s (GPU %d instance %d at %s)", ref.key, share.device,
                 device.gi_profile, gpu.index, device.gi, where)  # fmt: skip
        return prepared, device

    def edits(self, device: MigDevice, gpu: GpuInfo) -> tuple[ContainerEdits, tuple[str, ...]]:
        response = self._responses.build_mig([OfferedDevice(device, gpu)])
        edits = response_edits(response, self._responses, self._agent_dev_root)
        return edits, tuple(d.name for d in response.cdi_devices)

    def destroy(self, ref: ClaimRef, prepared: PreparedMig) -> None:
        """Destroy a claim's instance; DynamicMigError (reported) when the driver refuses."""
        try:
            self.mig.destroy(prepared.gpu_index, prepared.gi, prepared.ci)
        except DynamicMigError as err:
            message = f"claim {ref.key}: MIG {prepared.profile} {prepared.uuid}: {err}"
            self.report(ref, UNPREPARE_FAILED, message)
            raise DynamicMigError(message) from err
        log.info("claim %s: destroyed MIG %s (GPU %d instance %d)", ref.key, prepared.profile,
                 prepared.gpu_index, prepared.gi)  # fmt: skip

    def report(self, ref: ClaimRef, reason: str, message: str) -> None:
        if self._report is not None:
            self._report(ref, reason, message)

    def _create(self, share: ClaimShare) -> MigDevice:
        index = share.gpu_index
        if mig_slot(share.device) is not None:
            product = self.mig.product(index)
            found = slot_of(product, share.device) if product is not None else None
            if found is None:
                raise DynamicMigError(f"GPU {index} has no MIG placement {share.device}")
            return self.mig.create(index, *found)
        if index in self.mig.gpus():
            return self.mig.create_fit(index, share.cores, share.memory_mib)
        raise DynamicMigError(
            f"ShareConfig isolation: {ISOLATION_MIG} needs a GPU on dynamic MIG, and GPU {index} is not "
            f"(select its devices with device.attributes['gpu.vcuda.io'].isolation == '{ISOLATION_MIG}')"
        )
