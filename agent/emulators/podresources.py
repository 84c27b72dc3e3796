"""kubelet's pod-resources API v1 server, for the kubelet emulator.

Answers as kubelet 1.34 does, over a real unix socket:

- ``List``: every admitted pod, each app container with its device IDs per
  resource, one ``ContainerDevices`` per NUMA node of the devices (kubelet groups
  them so); containers without devices are listed with none.
- ``Get``: one pod by namespace and name. An unknown pod is a plain error, status
  UNKNOWN "pod <name> in namespace <ns> not found", as kubelet returns it (not
  NOT_FOUND). With ``serve_get=False`` it answers as kubelet 1.27-1.33 with the
  KubeletPodResourcesGet gate off: UNKNOWN "PodResources API Get method disabled".
- ``GetAllocatableResources``: the healthy devices of registered plugins, one
  entry per device (and NUMA node), as kubelet sends them.

Fault-injection knob (tests): ``set_delay(seconds)`` makes ``List`` and ``Get`` answer
that many seconds late, as a kubelet busy with a long sync loop does; lowering it releases
calls that are already waiting. ``calls`` counts the calls per method.

Not emulated: the CPU and memory managers (``cpu_ids`` and ``memory`` stay
empty), DRA (``dynamic_resources`` empty), restartable init (sidecar) containers,
and the pod's phase (a pod is listed from admission until it is released).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.emulators.pods import PodSpec
from agent.platform.kubelet.channel import unix_target
from agent.platform.kubelet.pb import podresources_v1_pb2 as pr
from agent.platform.kubelet.pb import podresources_v1_pb2_grpc as pr_grpc

NO_NUMA = -1  # kubelet's key for devices without topology


@dataclass(frozen=True)
class DeviceState:
    """What the pod-resources server reads from the emulator, taken under its lock."""

    pods: Sequence[PodSpec]  # admitted pods, in admission order
    allocated: Mapping[tuple[str, str, str], Sequence[str]]  # (pod uid, container, resource) -> IDs
    numa: Mapping[str, int]  # device ID -> NUMA node (NO_NUMA when the plugin gave none)
    allocatable: Mapping[str, Sequence[str]]  # resource -> healthy IDs of registered plugins


class PodResourcesServer(pr_grpc.PodResourcesListerServicer):
    """Serves ``PodResourcesLister`` on ``socket`` from the emulator's state."""

    def __init__(self, socket: Path, state: Callable[[], DeviceState], serve_get: bool = True) -> None:
        self.socket = socket
        self.serve_get = serve_get
        self._state = state
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._delay_s = 0.0
        self._stopping = False
        self._knob = threading.Condition()
        self.calls: Counter[str] = Counter()  # method name -> calls received

    def set_delay(self, seconds: float) -> None:
        """Fault-injection knob: List and Get answer ``seconds`` late (0: at once). Calls
        already waiting re-check against the new value, so lowering it releases them."""
        with self._knob:
            self._delay_s = max(0.0, seconds)
            self._knob.notify_all()

    def _stall(self, method: str) -> None:
        started = time.monotonic()
        with self._knob:
            self.calls[method] += 1
            while not self._stopping:
                left = started + self._delay_s - time.monotonic()
                if left <= 0:
                    break
                self._knob.wait(left)

    def start(self) -> None:
        # kubelet removes a stale socket and creates its own at start-up.
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        with self._knob:
            self._stopping = False
        # Enough workers that calls stalled by ``delay_s`` do not queue the ones behind them.
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="podres-emu")
        self._server = grpc.server(self._executor)
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(unix_target(self.socket))
        self._server.start()

    def stop(self) -> None:
        with self._knob:  # stalled calls end now, so the server stops at once
            self._stopping = True
            self._knob.notify_all()
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.socket.unlink(missing_ok=True)

    # PodResourcesLister ------------------------------------------------------
    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        self._stall("List")
        state = self._state()
        index = _by_container(state)
        return pr.ListPodResourcesResponse(
            pod_resources=[_pod_resources(p, index, state) for p in state.pods]
        )

    def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        if not self.serve_get:
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        self._stall("Get")
        state = self._state()
        # The latest admitted pod of that name wins, as kubelet's pod manager keeps one per name.
        matches = [
            p for p in state.pods if p.namespace == request.pod_namespace and p.name == request.pod_name
        ]
        if not matches:
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        pod = _pod_resources(matches[-1], _by_container(state), state)
        return pr.GetPodResourcesResponse(pod_resources=pod)

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        state = self._state()
        devices = [
            _container_devices(resource, numa, [device_id])
            for resource, ids in state.allocatable.items()
            for device_id in ids
            for numa in [state.numa.get(device_id, NO_NUMA)]
        ]
        return pr.AllocatableResourcesResponse(devices=devices)


_Index = dict[tuple[str, str], list[tuple[str, Sequence[str]]]]


def _by_container(state: DeviceState) -> _Index:
    """(pod uid, container) -> [(resource, IDs)], so a List is linear in the allocations."""
    index: _Index = {}
    for (uid, container, resource), ids in state.allocated.items():
        if ids:
            index.setdefault((uid, container), []).append((resource, ids))
    return index


def _pod_resources(pod: PodSpec, index: _Index, state: DeviceState) -> pr.PodResources:
    containers = []
    for container in pod.containers:
        if container.init:
            continue  # kubelet lists only restartable init containers, which the emulator lacks
        devices = [
            _container_devices(resource, numa, group)
            for resource, ids in index.get((pod.uid, container.name), [])
            for numa, group in _by_numa(ids, state.numa).items()
        ]
        containers.append(pr.ContainerResources(name=container.name, devices=devices))
    return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


def _by_numa(ids: Iterable[str], numa: Mapping[str, int]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for device_id in ids:
        groups.setdefault(numa.get(device_id, NO_NUMA), []).append(device_id)
    return groups


def _container_devices(resource: str, numa: int, ids: list[str]) -> pr.ContainerDevices:
    if numa == NO_NUMA:
        return pr.ContainerDevices(resource_name=resource, device_ids=ids)
    topology = pr.TopologyInfo(nodes=[pr.NUMANode(ID=numa)])
    return pr.ContainerDevices(resource_name=resource, device_ids=ids, topology=topology)
