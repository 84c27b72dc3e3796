"""The DevicePlugin gRPC service (kubelet API v1beta1) of one MIG resource:
``nvidia.com/mig-<profile>`` (strategy mixed) or ``nvidia.com/gpu`` (strategy single).

Its devices are whole MIG devices, listed by UUID with their parent GPU's NUMA node, from
the node's current MIG offer (``control/migoffers.py``): ListAndWatch sends the list again
when a device of this resource comes, goes or changes health. Allocate answers with what
``ResponseBuilder.build_mig`` gives (the UUIDs in NVIDIA_VISIBLE_DEVICES or as CDI names,
the device nodes); a device this resource does not have is INVALID_ARGUMENT, an Unhealthy
one FAILED_PRECONDITION.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import grpc

from agent.control.migoffers import MigOffers
from agent.domain.migoffer import OfferedDevice
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.watch import Wait, WatchedPlugin

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


class MigPluginService(WatchedPlugin):
    def __init__(
        self,
        resource: str,
        offers: MigOffers,
        responses: ResponseBuilder,
        on_allocate: Callable[[], None] = lambda: None,
        exclude: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        """``on_allocate``: told after each Allocate (the device guard's holdings re-read);
        ``exclude``: GPUs whose MIG devices are not this plugin's (isolated shares on demand)."""
        self.resource = resource
        self._exclude = exclude
        self._offers = offers
        self._responses = responses
        self._on_allocate = on_allocate

    def options(self) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def devices(self) -> tuple[int, tuple[OfferedDevice, ...]]:
        version, offer = self._offers.current()
        excluded = self._exclude()
        devices = offer.resources.get(self.resource, ())
        return version, tuple(d for d in devices if d.gpu.index not in excluded)

    def device_list(self) -> tuple[int, pb.ListAndWatchResponse]:
        version, devices = self.devices()
        listed = []
        for d in devices:
            numa = d.gpu.numa_node
            topology = None if numa is None else pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)])
            listed.append(pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY, topology=topology))
        return version, pb.ListAndWatchResponse(devices=listed)

    def changes(self) -> tuple[Wait, Callable[[], None]]:
        return self._offers.wait_for_change, self._offers.wake_all

    # DevicePlugin RPCs (options and ListAndWatch: WatchedPlugin) ----------------------------

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for creq in request.container_requests:
            must = list(creq.must_include_deviceIDs)
            rest = [i for i in creq.available_deviceIDs if i not in must]
            ids = (must + rest)[: creq.allocation_size]
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        _, devices = self.devices()
        by_id = {d.id: d for d in devices}
        responses = []
        for creq in request.container_requests:
            chosen = [self._usable(by_id, device_id, context) for device_id in creq.devices_ids]
            responses.append(self._responses.build_mig(chosen))
            where = ", ".join(f"{d.id} (GPU {d.gpu.index} GI {d.device.gi})" for d in chosen)
            log.info("Allocate %s: %s", self.resource, where)
        self._on_allocate()
        return pb.AllocateResponse(container_responses=responses)

    def _usable(
        self, by_id: dict[str, OfferedDevice], device_id: str, context: grpc.ServicerContext
    ) -> OfferedDevice:
        found = by_id.get(device_id)
        if found is None:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{self.resource} has no device {device_id}")
        if not found.healthy:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"{device_id} is Unhealthy: {found.reason}")
        return found

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    log.warning("Allocate refused: %s", message)
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
