"""The DevicePlugin gRPC service (kubelet API v1beta1) for nvidia.com/vcuda-core."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import grpc

from agent.control.allocations import Allocations
from agent.control.migsharebook import ShareKey
from agent.control.mpsgrants import MpsGrant
from agent.control.mpssharing import MpsSharing
from agent.control.recovery import LedgerRecovery
from agent.domain.health import HealthBoard
from agent.domain.ledger import Assignment
from agent.domain.placement import Placer
from agent.domain.requests import ResolvedRequest, resolve_ids
from agent.errors import (
    AllocationError,
    GpuUnhealthyError,
    InsufficientCapacityError,
    VcudaError,
    WrongPodStartError,
)
from agent.platform.gpu.inventory import GpuInfo, Topology
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.surfaces.deviceplugin.isolated import REFUSED_EVENT, IsolatedAllocator, check_plain
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.watch import Wait, WatchedPlugin

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


class DevicePluginService(WatchedPlugin):
    resource = "nvidia.com/vcuda-core"

    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        topology: Topology,
        board: HealthBoard,
        responses: ResponseBuilder,
        placer: Placer | None = None,
    ) -> None:
        self._gpus = tuple(gpus)
        self._board = board
        self._responses = responses
        self._placer = placer or Placer(self._gpus, topology)
        self._table = self._placer.table
        # With Kubernetes: which pod an Allocate is for, and kubelet's word on it.
        self.allocations: Allocations | None = None
        self.recovery: LedgerRecovery | None = None
        self.mps: MpsSharing | None = None  # MPS limits for shares (sharing mode mps/auto)
        self.isolated: IsolatedAllocator | None = None  # hardware-isolated shares (mig.onDemand)
        # GPUs that offer no shares, and why (in MIG mode: control/migoffers.py); a change
        # touches the health board, which wakes ListAndWatch.
        self.withheld: Callable[[], Mapping[int, str]] = dict

    def options(self) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    def device_list(self) -> tuple[int, pb.ListAndWatchResponse]:
        version, health = self._board.snapshot()
        withheld = self.withheld()
        devices: list[pb.Device] = []
        for gpu in self._gpus:
            if gpu.index in withheld:
                continue
            state = HEALTHY if health[gpu.index].healthy else UNHEALTHY
            topology = None
            if gpu.numa_node is not None:
                topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=gpu.numa_node)])
            ids = self._table.ids_by_gpu[gpu.index]
            devices.extend(pb.Device(ID=i, health=state, topology=topology) for i in ids)
        return version, pb.ListAndWatchResponse(devices=devices)

    def changes(self) -> tuple[Wait, Callable[[], None]]:
        return self._board.wait_for_change, self._board.wake_all

    # DevicePlugin RPCs (options and ListAndWatch: WatchedPlugin) --------------

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for creq in request.container_requests:
            available, must = list(creq.available_deviceIDs), list(creq.must_include_deviceIDs)
            try:
                if self.allocations is not None:
                    ids = self.allocations.prefer(available, must, creq.allocation_size)
                else:
                    ids = self._placer.preferred(available, must, creq.allocation_size)
            except VcudaError as err:
                _abort(context, err, "GetPreferredAllocation")
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        resolved: list[ResolvedRequest] = []
        assigned: list[Assignment] = []
        grants: list[MpsGrant | None] = []
        isolated: dict[int, pb.ContainerAllocateResponse] = {}  # position -> a MIG instance's answer
        keys: list[ShareKey] = []
        for creq in request.container_requests:
            try:
                item = resolve_ids(self._gpus, creq.devices_ids, self._table)
                self._check_healthy(item)
                assignment = None
                if self.isolated is not None and self.isolated.serves(item):
                    assignment, key, answer = self.isolated.allocate(
                        self.allocations, list(creq.devices_ids), item
                    )
                    assigned.append(assignment)
                    keys.append(key)
                    isolated[len(resolved)] = answer
                elif self.allocations is not None:
                    assignment = self.allocations.allocate(list(creq.devices_ids), item)
                    assigned.append(assignment)
                    self._check_plain(assignment)
            except VcudaError as err:
                self._undo(assigned, keys)
                _abort(context, err, "Allocate")
            plain = len(resolved) not in isolated  # a MIG instance needs no MPS limits
            resolved.append(item)
            grants.append(self.mps.grant_for(item, assignment) if plain and self.mps is not None else None)
        responses = [
            isolated.get(i) or self._responses.build(r, g)
            for i, (r, g) in enumerate(zip(resolved, grants, strict=True))
        ]
        response = pb.AllocateResponse(container_responses=responses)
        if self.allocations is None:
            for item in resolved:
                log.info(
                    "Allocate: %d vcuda-core on GPU %s", item.cores, ",".join(str(g.index) for g in item.gpus)
                )
        return response

    def _check_plain(self, assignment: Assignment) -> None:
        try:
            check_plain(self.allocations, assignment)
        except VcudaError as err:
            if self.allocations is not None:
                self.allocations.pod_event(assignment, REFUSED_EVENT, str(err))
            raise

    def _undo(self, assigned: list[Assignment], keys: list[ShareKey] | None = None) -> None:
        # kubelet retries the whole request; containers matched before the failure must be free again.
        if self.isolated is not None:
            for key in keys or ():
                self.isolated.undo(key)
        if self.allocations is not None:
            for item in assigned:
                self.allocations.ledger.release(item.pod_uid, item.container)
                self.allocations.forget(item)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        try:
            item = resolve_ids(self._gpus, request.devices_ids, self._table)
            self._check_healthy(item)
        except VcudaError as err:
            _abort(context, err, "PreStartContainer")
        if self.recovery is not None:
            outcome, owner = self.recovery.verify_owner(list(request.devices_ids))
            log.info(
                "PreStartContainer: %d IDs on GPU %s %s by kubelet's pod-resources",
                item.cores,
                ",".join(str(g.index) for g in item.gpus),
                outcome,
            )
            if self.allocations is not None:
                try:
                    self.allocations.check_start(list(request.devices_ids), owner)
                except VcudaError as err:
                    _abort(context, err, "PreStartContainer")
        return pb.PreStartContainerResponse()

    def _check_healthy(self, item: ResolvedRequest) -> None:
        _, health = self._board.snapshot()
        withheld = self.withheld()
        for gpu in item.gpus:
            if gpu.index in withheld:
                why = withheld[gpu.index]
                raise GpuUnhealthyError(f"GPU {gpu.index} ({gpu.uuid}) offers no vcuda-core: {why}")
            state = health[gpu.index]
            if not state.healthy:
                raise GpuUnhealthyError(f"GPU {gpu.index} ({gpu.uuid}) is Unhealthy: {state.reason}")


def _status_code(err: VcudaError) -> grpc.StatusCode:
    if isinstance(err, GpuUnhealthyError | WrongPodStartError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, InsufficientCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, AllocationError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, err: VcudaError, rpc: str) -> NoReturn:
    code = _status_code(err)
    log.warning("%s refused: %s", rpc, err)
    context.abort(code, str(err))
    raise AssertionError("unreachable: context.abort raises")
