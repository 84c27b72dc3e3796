"""Client of kubelet's pod-resources API v1: which pod and container hold which device IDs.

This is the stable, documented way to learn kubelet's device assignments (parsing
kubelet's private checkpoint broke gpu-manager when its format changed in 1.20).
kubelet identifies pods here by namespace and name only, NOT by UID: a pod deleted
and re-created under the same name is the same entry to this API, so callers that
key by UID must join through the pod cache.

``Get`` (one pod) is served from kubelet 1.34 (beta, on by default); older kubelets
answer UNIMPLEMENTED (< 1.27) or UNKNOWN "... Get method disabled" (gate off). The
client remembers that answer and filters ``List`` instead from then on.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from agent.errors import KubeletError
from agent.platform.kubelet.channel import rpc_error_parts, unix_target
from agent.platform.kubelet.pb import podresources_v1_pb2 as pr
from agent.platform.kubelet.pb import podresources_v1_pb2_grpc as pr_grpc

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# kubelet's own pod-resources client allows 16 MiB; List on a busy node with 100
# device IDs per GPU container can pass gRPC's default 4 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A fresh channel must dial afresh: channels share subchannels (and their
    # reconnect back-off) process-wide unless told otherwise.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_GET_DISABLED = "get method disabled"  # kubelet 1.27-1.33, gate KubeletPodResourcesGet off
_Response = TypeVar("_Response")


class PodResourcesError(KubeletError):
    """The pod-resources API could not be reached or refused a call."""


@dataclass(frozen=True)
class PodDevices:
    """The device IDs of one resource that kubelet assigned to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Calls kubelet's ``PodResourcesLister`` on its unix socket; thread-safe."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None
        self._get_served: bool | None = None  # None until kubelet has answered a Get

    @property
    def get_served(self) -> bool | None:
        """Whether kubelet serves ``Get``; ``None`` before the first ``get()``."""
        return self._get_served

    def list(self, resource: str | None = None) -> builtins.list[PodDevices]:
        """Every container's device IDs, optionally of one resource only."""
        response = self._call("List", lambda s: s.List(pr.ListPodResourcesRequest(), timeout=self.timeout_s))
        return [d for pod in response.pod_resources for d in flatten(pod) if _wanted(d, resource)]

    def get(self, namespace: str, name: str, resource: str | None = None) -> builtins.list[PodDevices] | None:
        """One pod's device IDs (``[]`` when it holds none); ``None`` when kubelet does not know
        the pod. Uses ``Get`` when kubelet serves it, else filters ``List``."""
        if self._get_served is not False:
            served, found = self._get(namespace, name)
            if served:
                return None if found is None else [d for d in flatten(found) if _wanted(d, resource)]
        response = self._call("List", lambda s: s.List(pr.ListPodResourcesRequest(), timeout=self.timeout_s))
        for pod in response.pod_resources:
            if pod.namespace == namespace and pod.name == name:
                return [d for d in flatten(pod) if _wanted(d, resource)]
        return None

    def allocatable(self, resource: str) -> builtins.list[str]:
        """The IDs of ``resource`` that kubelet can allocate (healthy devices of registered plugins)."""
        response = self._call(
            "GetAllocatableResources",
            lambda s: s.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=self.timeout_s),
        )
        return _merge_ids(d for d in response.devices if d.resource_name == resource)

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def _get(self, namespace: str, name: str) -> tuple[bool, pr.PodResources | None]:
        """``(served, pod)``: served is False when kubelet does not serve Get; pod None when unknown."""
        request = pr.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
        try:
            response = self._invoke(lambda s: s.Get(request, timeout=self.timeout_s))
        except grpc.RpcError as err:
            code, detail = rpc_error_parts(err)
            if code is grpc.StatusCode.UNIMPLEMENTED or (
                code is grpc.StatusCode.UNKNOWN and _GET_DISABLED in detail.lower()
            ):
                log.info("kubelet at %s serves no pod-resources Get (%s): using List", self.socket, detail)
                self._get_served = False
                return False, None
            # kubelet answers an unknown pod with a plain error (UNKNOWN), not NOT_FOUND.
            if code is grpc.StatusCode.NOT_FOUND or (
                code is grpc.StatusCode.UNKNOWN and "not found" in detail and name in detail
            ):
                self._get_served = True
                return True, None
            raise self._error("Get", code, detail) from err
        self._get_served = True
        return True, response.pod_resources

    def _call(self, method: str, call: Callable[[pr_grpc.PodResourcesListerStub], _Response]) -> _Response:
        try:
            return self._invoke(call)
        except grpc.RpcError as err:
            code, detail = rpc_error_parts(err)
            raise self._error(method, code, detail) from err

    def _invoke(self, call: Callable[[pr_grpc.PodResourcesListerStub], _Response]) -> _Response:
        try:
            return call(self._connect())
        except grpc.RpcError as err:
            if rpc_error_parts(err)[0] is not grpc.StatusCode.UNAVAILABLE:
                raise
        # kubelet restarted and re-created its socket: the old channel may sit in
        # reconnect back-off (up to minutes), so dial afresh once.
        self.close()
        return call(self._connect())

    def _connect(self) -> pr_grpc.PodResourcesListerStub:
        if not self.socket.exists():
            raise PodResourcesError(
                f"kubelet pod-resources socket {self.socket} does not exist: is kubelet running, and is "
                f"{self.socket.parent} mounted into the agent's container (hostPath)?"
            )
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(unix_target(self.socket), options=_CHANNEL_OPTIONS)
                self._stub = pr_grpc.PodResourcesListerStub(self._channel)
            return self._stub

    def _error(self, method: str, code: grpc.StatusCode, detail: str) -> PodResourcesError:
        hint = ""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = (
                f"; check that kubelet is running and that {self.socket.parent} is mounted "
                "into the agent's container (hostPath)"
            )
        return PodResourcesError(
            f"kubelet pod-resources {method} on {self.socket} failed ({code.name}): {detail}{hint}"
        )


def flatten(pod: pr.PodResources) -> builtins.list[PodDevices]:
    """One ``PodDevices`` per container and resource. kubelet sends one ``ContainerDevices``
    per NUMA node, so entries of the same resource are merged, in kubelet's order."""
    out: builtins.list[PodDevices] = []
    for container in pod.containers:
        by_resource: dict[str, builtins.list[pr.ContainerDevices]] = {}
        for devices in container.devices:
            by_resource.setdefault(devices.resource_name, []).append(devices)
        out.extend(
            PodDevices(pod.namespace, pod.name, container.name, resource, tuple(_merge_ids(entries)))
            for resource, entries in by_resource.items()
        )
    return out


def _merge_ids(entries: Iterable[pr.ContainerDevices]) -> builtins.list[str]:
    seen: dict[str, None] = {}
    for entry in entries:
        seen.update(dict.fromkeys(entry.device_ids))
    return builtins.list(seen)


def _wanted(devices: PodDevices, resource: str | None) -> bool:
    return resource is None or devices.resource == resource
