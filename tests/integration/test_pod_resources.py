"""kubelet's pod-resources API v1: the client against the kubelet emulator's server, over real
unix sockets, with the real agent (simulated GPUs) as the device plugin that kubelet admits from."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.pods import CORE_RESOURCE, ContainerRequest, PodSpec
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.platform.kubelet.channel import rpc_error_parts, unix_target
from agent.platform.kubelet.pb import podresources_v1_pb2 as pr
from agent.platform.kubelet.pb import podresources_v1_pb2_grpc as pr_grpc
from agent.platform.kubelet.podresources import PodDevices, PodResourcesClient, PodResourcesError
from tests.conftest import AgentProcess

Start = Callable[..., AgentProcess]
Emulator = Callable[..., KubeletEmulator]

SHARE = PodSpec(name="share", namespace="team-a", containers=(ContainerRequest("c", 30),))
MULTI = PodSpec(
    name="multi",
    namespace="team-b",
    containers=(
        ContainerRequest("setup", 100, init=True),
        ContainerRequest("train", 500),  # 5 whole GPUs: spans both NUMA nodes of 8xH100
        ContainerRequest("logger", 0),
        ContainerRequest("eval", 20),
    ),
)


@pytest.fixture
def emulator(short_dir: Path) -> Iterator[Emulator]:
    """A kubelet emulator serving pod-resources; uses the plugin dir ``start_agent`` uses."""
    started: list[KubeletEmulator] = []

    def start(serve_get: bool = True) -> KubeletEmulator:
        kubelet = KubeletEmulator(short_dir / "dp", short_dir / "pr" / "kubelet.sock", serve_get=serve_get)
        kubelet.start()
        started.append(kubelet)
        return kubelet

    yield start
    for kubelet in started:
        kubelet.stop()


@pytest.fixture
def client(short_dir: Path) -> Iterator[PodResourcesClient]:
    c = PodResourcesClient(short_dir / "pr" / "kubelet.sock", timeout_s=5.0)
    yield c
    c.close()


def truth(kubelet: KubeletEmulator, pod: PodSpec) -> list[PodDevices]:
    """What the emulator allocated to the pod's app containers, as the client should report it."""
    return [
        PodDevices(pod.namespace, pod.name, c.name, CORE_RESOURCE, tuple(ids))
        for c in pod.containers
        if (ids := kubelet.allocated.get((pod.uid, c.name, CORE_RESOURCE)))
    ]


def test_list_get_and_allocatable(
    start_agent: Start, emulator: Emulator, client: PodResourcesClient, short_dir: Path
) -> None:
    agent = start_agent("8xH100-80GB")
    kubelet = emulator()
    plugin = kubelet.wait_for_plugin()
    kubelet.admit(SHARE)
    kubelet.admit(MULTI)

    listed = client.list()
    assert listed == truth(kubelet, SHARE) + truth(kubelet, MULTI)
    assert [(d.pod, d.container, len(d.device_ids)) for d in listed] == [
        ("share", "c", 30),
        ("multi", "train", 500),
        ("multi", "eval", 20),
    ]
    assert client.list(resource="example.com/other") == []

    # On the wire, kubelet's shape: init containers absent, containers without devices
    # present with none, and one ContainerDevices per NUMA node (GPUs 0-3 are node 0, 4-7 node 1).
    with grpc.insecure_channel(unix_target(client.socket)) as channel:
        raw = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5)
    multi = next(p for p in raw.pod_resources if p.name == "multi")
    assert [c.name for c in multi.containers] == ["train", "logger", "eval"]
    train = multi.containers[0].devices
    assert sorted(d.topology.nodes[0].ID for d in train) == [0, 1]
    assert sum(len(d.device_ids) for d in train) == 500
    assert not multi.containers[1].devices

    assert client.get("team-b", "multi") == truth(kubelet, MULTI)
    assert client.get("team-b", "multi", resource=CORE_RESOURCE) == truth(kubelet, MULTI)
    assert client.get_served is True
    assert client.get("team-a", "multi") is None  # pods are known by namespace + name
    assert client.get("team-b", "nope") is None

    assert sorted(client.allocatable(CORE_RESOURCE)) == plugin.healthy_ids()
    assert len(plugin.healthy_ids()) == 800
    assert client.allocatable("example.com/other") == []
    # An unhealthy GPU's IDs leave the allocatable set (kubelet skips unhealthy devices).
    post_event(agent.sim_dir, 7, EventKind.XID.value, xid=79)
    assert kubelet.wait_for(lambda: len(plugin.healthy_ids()) == 700, 5.0)
    assert len(client.allocatable(CORE_RESOURCE)) == 700

    kubelet.release(SHARE)
    assert client.get("team-a", "share") is None
    assert client.list() == truth(kubelet, MULTI)


def test_get_falls_back_to_list_when_the_gate_is_off(
    start_agent: Start, emulator: Emulator, client: PodResourcesClient
) -> None:
    start_agent()
    kubelet = emulator(serve_get=False)
    kubelet.wait_for_plugin()
    kubelet.admit(SHARE)
    request = pr.GetPodResourcesRequest(pod_name="share", pod_namespace="team-a")
    with grpc.insecure_channel(unix_target(client.socket)) as channel, pytest.raises(grpc.RpcError) as err:
        pr_grpc.PodResourcesListerStub(channel).Get(request, timeout=5)
    assert rpc_error_parts(err.value) == (grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
    served = [client.get_served]  # unknown until kubelet has answered a Get
    assert client.get("team-a", "share") == truth(kubelet, SHARE)
    served.append(client.get_served)
    assert served == [None, False]
    assert client.get("team-a", "share") == truth(kubelet, SHARE)
    assert client.get("team-a", "nope") is None


def test_get_falls_back_on_a_kubelet_without_get(short_dir: Path) -> None:
    # kubelet < 1.27 has no Get method at all: gRPC answers UNIMPLEMENTED.
    pod = pr.PodResources(
        name="old",
        namespace="default",
        containers=[
            pr.ContainerResources(
                name="c",
                devices=[pr.ContainerDevices(resource_name=CORE_RESOURCE, device_ids=["a", "b"])],
            )
        ],
    )
    calls: list[str] = []

    def list_pods(request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> object:
        calls.append("List")
        return pr.ListPodResourcesResponse(pod_resources=[pod])

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            "List": grpc.unary_unary_rpc_method_handler(
                list_pods,
                request_deserializer=pr.ListPodResourcesRequest.FromString,
                response_serializer=pr.ListPodResourcesResponse.SerializeToString,
            )
        },
    )
    path = short_dir / "old.sock"
    with ThreadPoolExecutor(max_workers=2) as pool:
        server = grpc.server(pool, handlers=[handler])
        server.add_insecure_port(unix_target(path))
        server.start()
        client = PodResourcesClient(path)
        try:
            expected = [PodDevices("default", "old", "c", CORE_RESOURCE, ("a", "b"))]
            assert client.get("default", "old") == expected
            assert client.get_served is False
            assert client.get("default", "gone") is None
            assert calls == ["List", "List"]  # Get was tried once, then remembered as absent
        finally:
            client.close()
            server.stop(grace=None).wait(5)


def test_survives_a_kubelet_restart(
    start_agent: Start, emulator: Emulator, client: PodResourcesClient
) -> None:
    start_agent()
    kubelet = emulator()
    kubelet.wait_for_plugin()
    kubelet.admit(SHARE)
    before = client.list()
    assert before == truth(kubelet, SHARE)
    created = client.socket.stat()
    kubelet.restart()
    again = client.socket.stat()  # kubelet re-creates the socket (inodes alone are reused)
    assert (again.st_ino, again.st_ctime_ns) != (created.st_ino, created.st_ctime_ns)
    # The same client (its channel dialled the old socket) reads the pods again.
    assert client.list() == before
    assert client.get("team-a", "share") == before

    # A kubelet that died and left its socket: calls fail clearly, and work again as
    # soon as kubelet is back (the client does not sit out gRPC's reconnect back-off).
    kubelet.stop()
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(client.socket))
    for _ in range(2):
        with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
            client.list()
    kubelet.start()
    assert client.list() == before


def test_missing_socket_is_a_clear_error(short_dir: Path) -> None:
    client = PodResourcesClient(short_dir / "absent" / "kubelet.sock")
    with pytest.raises(PodResourcesError) as err:
        client.list()
    message = str(err.value)
    assert str(short_dir / "absent" / "kubelet.sock") in message
    assert "does not exist" in message and "mounted" in message


def test_dead_socket_is_a_clear_error(short_dir: Path) -> None:
    # A socket file left by a kubelet that is gone: connection refused.
    path = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    client = PodResourcesClient(path, timeout_s=2.0)
    try:
        for call in (client.list, lambda: client.get("ns", "p"), lambda: client.allocatable(CORE_RESOURCE)):
            with pytest.raises(PodResourcesError) as err:
                call()
            message = str(err.value)
            assert str(path) in message and "UNAVAILABLE" in message and "mounted" in message
    finally:
        client.close()
