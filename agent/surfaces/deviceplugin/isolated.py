"""Allocate of vcuda-core IDs on a GPU that serves hardware-isolated shares on demand
(``mig.onDemand``, in MIG mode; ``control/migshares.py``).

The IDs are matched to a pod's container as any share's are (``control/allocations.py``),
then the pod must carry ``nvidia.com/vcuda-isolation: mig`` (exactly; any other value is
refused with the rule, and so is a pod without it: such a GPU has no time-sliced shares).
The share gets a MIG instance of its own, the smallest profile covering its cores and memory
that fits (``domain/migfit.py``), and the answer is that MIG device's, as a static MIG
device's is (``responses.py``: ``NVIDIA_VISIBLE_DEVICES=MIG-<uuid>`` and exactly its device
nodes, or its CDI name), with ``VCUDA_CORE`` and ``VCUDA_ISOLATION=mig``. When no covering
profile fits, Allocate fails with migfit's reason and a Warning Event on the pod.

Conversely a pod annotated for isolation whose IDs are on a GPU that does not serve isolated
shares is refused (``check_plain``): it would get a time-sliced share it did not ask for.
"""

from __future__ import annotations

import logging

from agent.control.allocations import Allocations
from agent.control.migsharebook import ShareKey
from agent.control.migshares import MigShares
from agent.domain.annotations import ISOLATION, ISOLATION_MIG, AnnotationError, wants_isolation
from agent.domain.ledger import Assignment
from agent.domain.migoffer import OfferedDevice
from agent.domain.requests import ResolvedRequest
from agent.errors import AllocationError
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.surfaces.deviceplugin.responses import ResponseBuilder

log = logging.getLogger(__name__)

REFUSED_EVENT = "GPUIsolationRefused"


class IsolatedAllocator:
    def __init__(self, shares: MigShares, responses: ResponseBuilder) -> None:
        self.shares = shares
        self._responses = responses

    def serves(self, request: ResolvedRequest) -> bool:
        """Whether the IDs are on a GPU that serves isolated shares now."""
        ready = self.shares.ready()
        return any(g.index in ready for g in request.gpus)

    def allocate(
        self, allocations: Allocations | None, device_ids: list[str], request: ResolvedRequest
    ) -> tuple[Assignment, ShareKey, pb.ContainerAllocateResponse]:
        """Match, check the annotation, make the instance; AllocationError saying why not
        (the ledger entry is taken back by the caller's undo)."""
        (gpu,) = request.gpus if len(request.gpus) == 1 else (None,)
        if gpu is None or request.whole:
            raise AllocationError(
                f"GPU {', '.join(str(g.index) for g in request.gpus)} serves hardware-isolated shares "
                "only (mig.onDemand): a request below 100 vcuda-core on one GPU, with "
                f"{ISOLATION}: {ISOLATION_MIG}"
            )
        if allocations is None:
            raise AllocationError(
                f"GPU {gpu.index} serves hardware-isolated shares only: they need the Kubernetes API "
                f"(the pod's {ISOLATION} annotation)"
            )
        item = allocations.allocate(device_ids, request)
        try:
            key, response = self._serve(allocations, item, request)
        except AllocationError as err:
            allocations.pod_event(item, REFUSED_EVENT, str(err))
            allocations.ledger.release(item.pod_uid, item.container)
            allocations.forget(item)
            raise
        return item, key, response

    def _serve(
        self, allocations: Allocations, item: Assignment, request: ResolvedRequest
    ) -> tuple[ShareKey, pb.ContainerAllocateResponse]:
        gpu = request.gpus[0]
        pod = allocations.pod_of(item)
        who = f"pod {item.namespace}/{item.pod} container {item.container}"
        try:
            wanted = pod is not None and wants_isolation(pod.annotations)
        except AnnotationError as err:
            raise AllocationError(f"{who}: {err}") from err
        if not wanted:
            raise AllocationError(
                f"{who} was given vcuda-core of GPU {gpu.index}, which serves hardware-isolated shares "
                f"only (mig.onDemand): annotate the pod {ISOLATION}: {ISOLATION_MIG} for a MIG instance "
                "of its own, or leave it to the GPUs with time-sliced shares"
            )
        key = ShareKey(item.pod_uid, item.namespace, item.pod, item.container)
        try:
            device = self.shares.create(gpu, key, item.cores, item.memory_mib)
        except AllocationError as err:
            raise AllocationError(f"{who}: no hardware-isolated share: {err}") from err
        response = self._responses.build_mig([OfferedDevice(device, gpu)])
        response.envs.update({"VCUDA_CORE": str(item.cores), "VCUDA_ISOLATION": ISOLATION_MIG})
        return key, response

    def undo(self, key: ShareKey) -> None:
        """A later container of the same Allocate failed: kubelet does not keep this answer."""
        self.shares.release(key)


def check_plain(allocations: Allocations | None, item: Assignment | None) -> None:
    """AllocationError when the pod asks for isolation (or says something else in its isolation
    annotation) but its IDs are on a GPU without isolated shares."""
    if allocations is None or item is None:
        return
    pod = allocations.pod_of(item)
    if pod is None or ISOLATION not in pod.annotations:
        return
    who = f"pod {item.namespace}/{item.pod} container {item.container}"
    try:
        wants_isolation(pod.annotations)
    except AnnotationError as err:
        raise AllocationError(f"{who}: {err}") from err
    raise AllocationError(
        f"{who} asks for {ISOLATION}: {ISOLATION_MIG} but was given vcuda-core of GPU "
        f"{', '.join(map(str, item.gpus))}, which has time-sliced shares only: hardware-isolated shares "
        "come from the GPUs of the node config's mig.onDemand"
    )
