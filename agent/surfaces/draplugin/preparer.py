"""NodePrepareResources / NodeUnprepareResources without the gRPC: read the claim, check it,
write its CDI spec, record it.

A claim is prepared once: a second prepare of the same UID answers from the record (while its
spec file exists) without asking the API server again. A prepared claim's CDI spec has one
device per allocated device of our driver, named ``<claim UID>-<request>-gpu<index>``, whose
edits are what Allocate hands a device-plugin container for the same cores on the same GPU
(the ``ResponseBuilder`` of the device plugin, so both paths give a container the same device
nodes, driver mounts, ``VCUDA_*`` and ``CUDA_MPS_*`` environment), plus /dev/nvidia-modeset
where the host has it. With the ``cdi`` device-list strategy the device also carries
``nvidia.com/gpu=<uuid>``, so NVIDIA's own spec supplies the driver files, as with Allocate.

A share that a MIG instance serves (dynamic MIG, agent/surfaces/draplugin/migprepare.py) gets
the instance created first and the MIG device's edits instead; the instances are recorded with
the claim, destroyed again when a later share of the claim fails, and destroyed by unprepare
before the record goes (a refusal keeps the record: kubelet asks again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from agent.control.draclaims import PreparedClaims
from agent.control.mpsgrants import MpsGrant
from agent.domain.dra import (
    CDI_KIND,
    DRIVER,
    ClaimError,
    ClaimRef,
    ClaimShare,
    PreparedClaim,
    PreparedDevice,
    PreparedMig,
    cdi_device_name,
    claim_ref,
    claim_shares,
    share_ceiling,
)
from agent.domain.health import HealthBoard
from agent.domain.requests import ResolvedRequest
from agent.errors import GpuUnhealthyError, NoSuchGpuError, PlatformError, VcudaError
from agent.platform.cdi import (
    CdiDevice,
    ContainerEdits,
    qualified_name,
    remove_spec,
    spec_json,
    transient_spec_path,
    write_spec,
)
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.migprepare import MigPrepare, response_edits, wants_mig

log = logging.getLogger(__name__)

CLAIM_ANNOTATION = f"{DRIVER}/claim"
_LOCK_STRIPES = 64  # prepares of different claims run in parallel; of one claim, one at a time


class ClaimReader(Protocol):
    def get(self, namespace: str, name: str) -> dict[str, Any]: ...


class MpsGrants(Protocol):
    def grant_share(self, gpu: GpuInfo, ceiling: int, memory_mib: int | None) -> MpsGrant | None: ...


class ClaimPreparer:
    def __init__(
        self,
        *,
        node_name: str,
        gpus: Sequence[GpuInfo],
        claims: ClaimReader,
        responses: ResponseBuilder,
        store: PreparedClaims,
        cdi_dir: Path,
        board: HealthBoard | None = None,
        mps: MpsGrants | None = None,
        default_policy: Callable[[], str] = lambda: "fixed-share",
        ceiling: Callable[[ClaimShare], int] | None = None,
        agent_dev_root: Path | None = None,
        dynamic_mig: MigPrepare | None = None,
    ) -> None:
        self.node_name = node_name
        self.mig = dynamic_mig
        self._gpus = {g.index: g for g in gpus}
        self._claims = claims
        self._responses = responses
        self.store = store
        self.cdi_dir = cdi_dir
        self._board = board
        self._mps = mps
        self._default_policy = default_policy
        self._ceiling = ceiling or (lambda share: share_ceiling(share, self._default_policy()))
        # Where this process sees the host's /dev (the DaemonSet mounts the driver root elsewhere).
        self._agent_dev_root = agent_dev_root or responses.dev_root
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    def spec_path(self, uid: str) -> Path:
        return transient_spec_path(self.cdi_dir, CDI_KIND, uid)

    def prepare(self, ref: ClaimRef) -> PreparedClaim:
        """The claim's devices and CDI IDs; a VcudaError whose text says why it cannot be."""
        _check_ref(ref)
        with self._lock(ref.uid):
            known = self.store.get(ref.uid)
            if known is not None and self.spec_path(ref.uid).exists():
                return known
            claim = self._claims.get(ref.namespace, ref.name)
            actual = claim_ref(claim)
            if actual.uid != ref.uid:
                # The claim was deleted and re-created under the same name: not the one kubelet means.
                raise ClaimError(f"claim {ref.key} has UID {actual.uid}, kubelet asked for {ref.uid}")
            status = claim.get("status")
            if not isinstance(status, dict) or not status.get("allocation"):
                raise ClaimError(f"claim {ref.key} is not allocated (no status.allocation)")
            try:
                shares = claim_shares(claim, self.node_name)
            except ClaimError as err:
                raise ClaimError(f"claim {ref.key}: {err}") from err
            if not shares:
                raise ClaimError(f"claim {ref.key} has no device of driver {DRIVER} allocated")
            migs: list[PreparedMig] = []
            try:
                devices, prepared = self._devices(ref, shares, migs)
                path = self.spec_path(ref.uid)
                write_spec(path, spec_json(CDI_KIND, devices, {CLAIM_ANNOTATION: ref.key}))
            except VcudaError:
                self._undo(ref, migs)
                raise
            result = PreparedClaim(ref, tuple(shares), tuple(prepared), tuple(migs))
            try:
                self.store.add(result)
            except PlatformError:
                # Not recorded means not prepared: kubelet will ask again, and must not find a
                # spec (or an instance) that a restarted agent would not know to remove.
                remove_spec(path)
                self._undo(ref, migs)
                raise
            self._settle(migs)
        log.info(
            "prepared claim %s (%s): %s",
            ref.key,
            ref.uid,
            ", ".join(f"{s.request}: {s.cores} cores of {s.device}" for s in shares),
        )
        return result

    def unprepare(self, ref: ClaimRef) -> None:
        """Remove the claim's spec and record; an unknown claim is already unprepared."""
        _check_ref(ref)
        with self._lock(ref.uid):
            held = self.store.get(ref.uid)
            for mig in held.mig if held is not None else ():
                if self.mig is None:
                    raise ClaimError(f"claim {ref.key} holds MIG {mig.uuid}, and dynamic MIG is off")
                self.mig.destroy(ref, mig)  # refused: the record stays, kubelet asks again
            removed = remove_spec(self.spec_path(ref.uid))
            known = self.store.remove(ref.uid)
        if known is not None or removed:
            log.info("unprepared claim %s (%s)", ref.key, ref.uid)

    # Devices and their edits -----------------------------------------------------------------
    def _devices(
        self, ref: ClaimRef, shares: Sequence[ClaimShare], migs: list[PreparedMig]
    ) -> tuple[list[CdiDevice], list[PreparedDevice]]:
        """The CDI devices and answers; each MIG instance created is appended to ``migs``."""
        devices: list[CdiDevice] = []
        prepared: list[PreparedDevice] = []
        for share in shares:
            gpu = self._gpu(ref, share)
            name = cdi_device_name(ref.uid, share.request, share.gpu_index, [d.name for d in devices])
            if self.mig is not None and self.mig.wants(share):
                mig, device = self.mig.create(ref, share)
                migs.append(mig)
                edits, more_ids = self.mig.edits(device, gpu)
            elif wants_mig(share, frozenset()):
                raise ClaimError(
                    f"claim {ref.key}: {share.device} needs a MIG instance, and dynamic MIG is off on node "
                    f"{self.node_name} (node config mig.dynamic)"
                )
            else:
                edits, more_ids = self._edits(share, gpu)
            devices.append(CdiDevice(name, edits))
            ids = (qualified_name(CDI_KIND, name), *more_ids)
            prepared.append(PreparedDevice((share.request,), share.pool, share.device, ids))
        return devices, prepared

    def _gpu(self, ref: ClaimRef, share: ClaimShare) -> GpuInfo:
        gpu = self._gpus.get(share.gpu_index)
        if gpu is None:
            raise NoSuchGpuError(
                f"claim {ref.key}: device {share.device} is allocated, but node {self.node_name} "
                f"has GPUs {sorted(self._gpus)}"
            )
        if self._board is not None:
            state = self._board.snapshot()[1][gpu.index]
            if not state.healthy:
                raise GpuUnhealthyError(
                    f"claim {ref.key}: GPU {gpu.index} ({gpu.uuid}) is Unhealthy: {state.reason}"
                )
        return gpu

    def _edits(self, share: ClaimShare, gpu: GpuInfo) -> tuple[ContainerEdits, tuple[str, ...]]:
        request = ResolvedRequest(share.cores, (gpu,))
        grant = None
        if self._mps is not None and not request.whole:
            grant = self._mps.grant_share(gpu, self._ceiling(share), share.memory_mib or None)
        response = self._responses.build(request, grant)
        edits = response_edits(response, self._responses, self._agent_dev_root)
        return edits, tuple(d.name for d in response.cdi_devices)

    def _undo(self, ref: ClaimRef, migs: Sequence[PreparedMig]) -> None:
        """Destroy the instances a failed prepare created (what stays is cleaned up later)."""
        for mig in migs:
            try:
                if self.mig is not None:
                    self.mig.destroy(ref, mig)
            except VcudaError as err:
                log.warning("claim %s: %s (the periodic cleanup tries again)", ref.key, err)
        self._settle(migs)

    def _settle(self, migs: Sequence[PreparedMig]) -> None:
        if self.mig is not None and migs:
            self.mig.mig.settle([(m.gpu_index, m.gi) for m in migs])

    def _lock(self, uid: str) -> threading.Lock:
        return self._locks[hash(uid) % _LOCK_STRIPES]


def _check_ref(ref: ClaimRef) -> None:
    missing = [f for f in ("namespace", "name", "uid") if not getattr(ref, f)]
    if missing:
        raise ClaimError(f"kubelet named a claim without {', '.join(missing)}: {ref}")
