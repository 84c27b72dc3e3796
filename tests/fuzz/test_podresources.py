"""kubelet's pod-resources answers (List, Get, GetAllocatableResources) as the agent reads them,
built by hypothesis and decoded from random bytes, and the ledger recovery that trusts them.

Property: the client returns well-formed records (strings, distinct IDs, only the resource
asked for); recovery (agent start) and verification (PreStartContainer) finish with a report
or a verdict and leave no GPU oversubscribed, whatever kubelet says; nothing raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from google.protobuf.message import DecodeError
from hypothesis import example, given
from hypothesis import strategies as st

from agent.control.annotator import Annotator
from agent.control.recovery import LedgerRecovery
from agent.domain.ids import UNITS_PER_GPU
from agent.domain.ledger import Ledger
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE
from agent.platform.kubelet.pb import podresources_v1_pb2 as pr
from agent.platform.kubelet.podresources import PodDevices, PodResourcesClient
from tests.fuzz.node import GPUS, IDS, TABLE, Nowhere, PodCache, id_lists
from tests.fuzz.strategies import raw_bytes
from tests.fuzz.tally import count
from tests.unit.kubefixtures import NODE, container, make_pod

# Mostly names the pod cache knows, so records reach the ledger; sometimes anything.
namespaces = st.sampled_from(["default", "ml"]) | st.text(max_size=8)
pod_names = st.sampled_from(["a", "b", "c"]) | st.text(max_size=8)
container_names = st.sampled_from(["c", "d", ""]) | st.text(max_size=8)
resources = st.sampled_from([CORE_RESOURCE, MEMORY_RESOURCE, "nvidia.com/gpu", ""]) | st.text(max_size=20)
container_devices = st.builds(
    lambda resource, ids, numa: pr.ContainerDevices(
        resource_name=resource, device_ids=ids, topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=numa)])
    ),
    resources,
    id_lists,
    st.integers(-(2**63), 2**63 - 1),
)
pod_resources = st.builds(
    lambda ns, name, containers: pr.PodResources(namespace=ns, name=name, containers=containers),
    namespaces,
    pod_names,
    st.lists(
        st.builds(
            lambda name, devices: pr.ContainerResources(name=name, devices=devices),
            container_names,
            st.lists(container_devices, max_size=3),
        ),
        max_size=3,
    ),
)
listings = st.builds(
    lambda pods: pr.ListPodResourcesResponse(pod_resources=pods), st.lists(pod_resources, max_size=4)
)
# The pods in the cache: shares, whole GPUs and a container with a malformed quantity.
cache = [
    make_pod("a", container("c", 30, 1000)),
    make_pod("b", container("c", 100), container("d", 50, 500)),
    make_pod("c", container("c", 200, 1)),
    make_pod("x", {"name": "c", "resources": {"limits": {CORE_RESOURCE: "1", MEMORY_RESOURCE: "²"}}}),
]


class Stub:
    """A PodResourcesLister stub that answers with fixed messages."""

    def __init__(
        self,
        listing: pr.ListPodResourcesResponse,
        got: pr.GetPodResourcesResponse | None = None,
        allocatable: pr.AllocatableResourcesResponse | None = None,
    ) -> None:
        self.listing = listing
        self.got = got or pr.GetPodResourcesResponse()
        self.allocatable = allocatable or pr.AllocatableResourcesResponse()

    def List(self, request: object, timeout: float | None = None) -> pr.ListPodResourcesResponse:
        return self.listing

    def Get(self, request: object, timeout: float | None = None) -> pr.GetPodResourcesResponse:
        return self.got

    def GetAllocatableResources(
        self, request: object, timeout: float | None = None
    ) -> pr.AllocatableResourcesResponse:
        return self.allocatable


def client(stub: Stub) -> PodResourcesClient:
    # Any existing path will do: the client only checks that its socket exists before calling.
    truth = PodResourcesClient(Path(__file__))
    truth._stub = cast(Any, stub)  # the gRPC channel is what is faked
    return truth


def well_formed(records: list[PodDevices], resource: str | None) -> None:
    for r in records:
        assert all(isinstance(v, str) for v in (r.namespace, r.pod, r.container, r.resource))
        assert all(isinstance(d, str) for d in r.device_ids)
        assert len(set(r.device_ids)) == len(r.device_ids), "IDs merged across NUMA entries once"
        assert resource is None or r.resource == resource


def read_all(stub: Stub, namespace: str, name: str) -> None:
    count("podresources.client")
    truth = client(stub)
    for resource in (None, CORE_RESOURCE):
        well_formed(truth.list(resource), resource)
        got = truth.get(namespace, name, resource)
        if got is not None:
            well_formed(got, resource)
    allocatable = truth.allocatable(CORE_RESOURCE)
    assert len(set(allocatable)) == len(allocatable)


def recovery_of(stub: Stub, ledger: Ledger) -> LedgerRecovery:
    """The agent's recovery over the fake pod cache, kubelet answering with ``stub``."""
    return LedgerRecovery(
        gpus=GPUS,
        table=TABLE,
        ledger=ledger,
        pods=PodCache(cache),
        truth=client(stub),
        annotator=Annotator(Nowhere()),
        node_name=NODE,
    )


def recover(stub: Stub, verify_ids: list[str]) -> None:
    """Agent start (rebuild), then a PreStartContainer (verify), trusting what kubelet says."""
    count("podresources.recovery")
    ledger = Ledger(GPUS)
    recovery = recovery_of(stub, ledger)
    report = recovery.rebuild()
    assert report.source == "pod-resources"
    assert all(isinstance(p, str) and p for p in report.problems)
    assert recovery.verify(verify_ids) in ("confirmed", "corrected", "unverified")
    for gpu in GPUS:  # whatever kubelet claimed, the ledger never holds more than a GPU has
        usage = ledger.usage(gpu.index)
        assert usage.cores <= UNITS_PER_GPU and usage.memory_mib <= usage.memory_capacity_mib
    for item in ledger.assignments():  # recorded IDs are this node's, on the GPUs recorded
        assert {TABLE.locate(d)[0] for d in item.device_ids} == set(item.gpus)


def record(namespace: str, name: str, container_name: str, ids: list[str]) -> pr.PodResources:
    devices = pr.ContainerDevices(resource_name=CORE_RESOURCE, device_ids=ids)
    return pr.PodResources(
        namespace=namespace,
        name=name,
        containers=[pr.ContainerResources(name=container_name, devices=[devices])],
    )


@given(listing=listings, pod=pod_resources, namespace=namespaces, name=pod_names)
def test_client_answers(
    listing: pr.ListPodResourcesResponse, pod: pr.PodResources, namespace: str, name: str
) -> None:
    allocatable = pr.AllocatableResourcesResponse(
        devices=[d for p in listing.pod_resources for c in p.containers for d in c.devices]
    )
    read_all(Stub(listing, pr.GetPodResourcesResponse(pod_resources=pod), allocatable), namespace, name)


@given(listing=listings, verify_ids=id_lists)
@example(  # IDs of two GPUs for a share, and a container the pod does not have
    listing=pr.ListPodResourcesResponse(
        pod_resources=[
            record("default", "a", "c", [IDS[0][0], IDS[1][0]]),
            record("default", "a", "zz", IDS[0][:1]),
        ]
    ),
    verify_ids=[IDS[0][0]],
)
@example(  # a malformed vcuda-memory quantity on the pod kubelet names
    listing=pr.ListPodResourcesResponse(pod_resources=[record("default", "x", "c", IDS[0][:1])]),
    verify_ids=IDS[0][:1],
)
def test_recovery_trusts_no_record(listing: pr.ListPodResourcesResponse, verify_ids: list[str]) -> None:
    recover(Stub(listing), verify_ids)


@given(data=raw_bytes, verify_ids=id_lists)
def test_answers_from_bytes(data: bytes, verify_ids: list[str]) -> None:
    # What does not decode never reaches the client: gRPC's deserializer turns it into an
    # RpcError (INTERNAL), which the client reports as PodResourcesError.
    try:
        listing = pr.ListPodResourcesResponse.FromString(data)
        got = pr.GetPodResourcesResponse.FromString(data)
        allocatable = pr.AllocatableResourcesResponse.FromString(data)
    except DecodeError:
        count("podresources.client")
        return
    stub = Stub(listing, got, allocatable)
    read_all(stub, "default", "a")
    recover(stub, verify_ids)


def test_the_cache_pods_are_what_recovery_expects() -> None:
    # The properties above are only as good as records that hit real pods: check that one does.
    stub = Stub(pr.ListPodResourcesResponse(pod_resources=[record("default", "a", "c", IDS[0][:30])]))
    ledger = Ledger(GPUS)
    recovery_of(stub, ledger).rebuild()
    assert [(a.pod, a.cores, a.memory_mib) for a in ledger.assignments()] == [("a", 30, 1000)]
