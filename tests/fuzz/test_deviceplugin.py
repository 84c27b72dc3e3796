"""The device-plugin RPCs kubelet sends (Allocate, PreStartContainer, GetPreferredAllocation),
built by hypothesis and decoded from random bytes, against the service with and without the
Kubernetes side (Allocations over a pod cache whose pods carry hostile annotations).

Property: an RPC answers a response of the request's shape, or aborts with a status that says
why (naming the offending device ID where one is unknown); no other exception escapes (gRPC
would answer UNKNOWN with a Python traceback in the agent's log).
"""

from __future__ import annotations

from typing import NoReturn, cast

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import example, given
from hypothesis import strategies as st

from agent.control.allocations import Allocations
from agent.control.annotator import Annotator
from agent.domain.annotations import predicate_key
from agent.domain.health import HealthBoard
from agent.domain.ledger import Ledger
from agent.platform.driverfiles import DriverFiles
from agent.platform.gpu.inventory import Topology
from agent.platform.kube.pods import PodInfo
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.service import DevicePluginService
from tests.fuzz.node import GPUS, IDS, KNOWN, PLACER, TABLE, Nowhere, PodCache, device_ids, id_lists
from tests.fuzz.strategies import raw_bytes
from tests.fuzz.tally import count
from tests.unit.kubefixtures import NODE, container, make_pod

RESPONSES = ResponseBuilder(DeviceListStrategy.MOUNTS, DriverFiles())
UNHEALTHY = 2  # one GPU is Unhealthy: Allocate on it must be refused, not crash
# What an RPC may abort with: the request's fault, the node's state, or its capacity.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """The only part of a ServicerContext the unary RPCs use."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)


CONTEXT = cast(grpc.ServicerContext, FakeContext())


def plugin(pods: list[PodInfo] | None) -> DevicePluginService:
    """A fresh service per case; ``pods`` None: without Kubernetes (plain placement)."""
    board = HealthBoard(g.index for g in GPUS)
    board.set(UNHEALTHY, False, "XID 79")
    service = DevicePluginService(GPUS, Topology(), board, RESPONSES, PLACER)
    if pods is not None:
        service.allocations = Allocations(
            node_name=NODE,
            table=TABLE,
            placer=PLACER,
            ledger=Ledger(GPUS),
            pods=PodCache(pods),
            annotator=Annotator(Nowhere()),
            events=Nowhere(),
            wait_for_pod_s=0.0,
        )
    return service


sizes = st.integers(-5, 310) | st.integers(-(2**31), 2**31 - 1)  # int32 on the wire
# Pods waiting on this node, with the extender's annotation in any state.
annotation_values = st.sampled_from(["0", "1", "2", "0,1", "1,2", "99", "", "x", "²"]) | st.text(max_size=8)
pods = st.lists(
    st.builds(
        lambda name, cores, memory, predicate: make_pod(
            name,
            container("c", cores, memory),
            annotations={} if predicate is None else {predicate_key(0, False): predicate},
        ),
        st.sampled_from(["a", "b", "c", "d"]),
        st.sampled_from([1, 30, 50, 99, 100, 200, 300, 150]),
        st.sampled_from([None, 1000, 200_000]),
        st.none() | annotation_values,
    ),
    max_size=3,
    unique_by=lambda p: p.name,
)
clusters = st.none() | pods


def first_unknown(ids: list[str]) -> str | None:
    """The ID the refusal must name: the first one this node does not have, when the request's
    only fault can be reported per ID (no duplicates, which are refused first)."""
    if len(set(ids)) != len(ids):
        return None
    return next((d for d in ids if d not in KNOWN), None)


def refused(err: Aborted, ids: list[str] | None) -> None:
    assert err.code in REFUSALS, err
    assert err.details
    unknown = first_unknown(ids) if ids is not None else None
    if unknown is not None:
        assert repr(unknown) in err.details, (unknown, err.details)


def allocate(request: pb.AllocateRequest, cluster: list[PodInfo] | None) -> None:
    count("deviceplugin.Allocate")
    first = list(request.container_requests[0].devices_ids) if request.container_requests else None
    try:
        response = plugin(cluster).Allocate(request, CONTEXT)
    except Aborted as err:
        refused(err, first)
        return
    assert len(response.container_responses) == len(request.container_requests)
    for creq, cres in zip(request.container_requests, response.container_responses, strict=True):
        assert cres.envs["VCUDA_CORE"] == str(len(creq.devices_ids))


def prestart(request: pb.PreStartContainerRequest) -> None:
    count("deviceplugin.PreStartContainer")
    try:
        response = plugin(None).PreStartContainer(request, CONTEXT)
    except Aborted as err:
        refused(err, list(request.devices_ids))
        return
    assert isinstance(response, pb.PreStartContainerResponse)


def prefer(request: pb.PreferredAllocationRequest, cluster: list[PodInfo] | None) -> None:
    count("deviceplugin.GetPreferredAllocation")
    try:
        response = plugin(cluster).GetPreferredAllocation(request, CONTEXT)
    except Aborted as err:
        refused(err, None)
        return
    assert len(response.container_responses) == len(request.container_requests)
    for creq, cres in zip(request.container_requests, response.container_responses, strict=True):
        chosen, available = list(cres.deviceIDs), set(creq.available_deviceIDs)
        # What kubelet then allocates: exactly the size, distinct, offered, with the must-includes.
        assert len(chosen) == creq.allocation_size, (len(chosen), creq.allocation_size)
        assert len(set(chosen)) == len(chosen)
        assert set(chosen) <= available
        assert set(creq.must_include_deviceIDs) <= set(chosen)


allocate_requests = st.builds(
    lambda lists: pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in lists]
    ),
    st.lists(id_lists, max_size=3),
)


@given(request=allocate_requests, cluster=clusters)
@example(request=pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()]), cluster=None)
@example(  # any pod's predicate annotation "²" (isdigit() but not int()) broke every Allocate
    request=pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=IDS[0][:1])]),
    cluster=[make_pod("a", container("c", 1), annotations={predicate_key(0, False): "²"})],
)
def test_allocate(request: pb.AllocateRequest, cluster: list[PodInfo] | None) -> None:
    allocate(request, cluster)


@given(ids=id_lists)
def test_prestart(ids: list[str]) -> None:
    prestart(pb.PreStartContainerRequest(devices_ids=ids))


@st.composite
def preferred_requests(draw: st.DrawFn) -> pb.PreferredAllocationRequest:
    containers = []
    for _ in range(draw(st.integers(0, 2))):
        available = draw(id_lists)
        must = draw(st.lists(st.sampled_from(available), max_size=3) if available else st.just([]))
        if draw(st.booleans()):
            must += draw(st.lists(device_ids, max_size=2))  # not offered: kubelet never does it
        containers.append(
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=draw(sizes)
            )
        )
    return pb.PreferredAllocationRequest(container_requests=containers)


def preferred(available: list[str], must: list[str], size: int) -> pb.PreferredAllocationRequest:
    one = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
    )
    return pb.PreferredAllocationRequest(container_requests=[one])


@given(request=preferred_requests(), cluster=clusters)
# Each of these answered IDs kubelet could not use (repeated, too many, too few) or crashed.
@example(request=preferred(IDS[0], [IDS[0][0]] * 2, 2), cluster=None)
@example(request=preferred(IDS[0], IDS[0][:2], 1), cluster=None)
@example(request=preferred([IDS[0][0]] * 50 + IDS[1][:10], [], 30), cluster=None)
@example(request=preferred(IDS[0] + IDS[1], [IDS[0][0], IDS[1][0]], 100), cluster=None)  # math.comb(n, -1)
def test_preferred_allocation(request: pb.PreferredAllocationRequest, cluster: list[PodInfo] | None) -> None:
    prefer(request, cluster)


# From bytes: what does not decode is refused by gRPC's deserializer before our code runs.
@pytest.mark.parametrize(
    "message", [pb.AllocateRequest, pb.PreStartContainerRequest, pb.PreferredAllocationRequest]
)
@given(data=raw_bytes, cluster=clusters)
def test_rpc_from_bytes(message: type[Message], data: bytes, cluster: list[PodInfo] | None) -> None:
    try:
        request = message.FromString(data)
    except DecodeError:
        count("deviceplugin.bytes")
        return
    if isinstance(request, pb.AllocateRequest):
        allocate(request, cluster)
    elif isinstance(request, pb.PreStartContainerRequest):
        prestart(request)
    else:
        assert isinstance(request, pb.PreferredAllocationRequest)
        prefer(request, cluster)


def test_the_success_branch_is_reached() -> None:
    # A request that matches a waiting pod is allocated: the properties above see answers too.
    share = make_pod("a", container("c", 30, 1000))
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=IDS[0][:30])])
    response = plugin([share]).Allocate(request, CONTEXT)
    assert response.container_responses[0].envs["VCUDA_CORE"] == "30"
    chosen = plugin([share]).GetPreferredAllocation(preferred(IDS[0] + IDS[1], [], 30), CONTEXT)
    assert len(chosen.container_responses[0].deviceIDs) == 30
