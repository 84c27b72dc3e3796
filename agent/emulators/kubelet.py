"""An emulator of kubelet's device manager (for the demo, tests and benchmarks).

It speaks the real device plugin API v1beta1 over real unix sockets, from
kubelet's side: it serves ``Registration`` on ``<dir>/kubelet.sock``, dials a
plugin's endpoint when it registers, consumes ``ListAndWatch``, and admits pods
as kubelet's device manager does: available = healthy IDs not in use,
``GetPreferredAllocation`` when the plugin offers it (an error fails admission; a
preference of the wrong size falls back to the first available IDs),
``Allocate`` per container, then ``PreStartContainer`` when required (``allocate`` and
``pre_start`` are those steps one at a time, for tests that stop between them).
``restart()`` does what a kubelet restart does to the directory: delete every
socket in it except the checkpoint, then create kubelet.sock again; allocations
survive, as they do in kubelet's checkpoint. Given ``pod_resources_socket``, it
also serves kubelet's pod-resources API v1 there (``emulators/podresources.py``),
re-created on restart as kubelet does.

Not emulated: NUMA topology hints and the Topology Manager (the NUMA node of each
device is only reported back by pod-resources), device reuse between init and app
containers (init containers release their devices when admission ends), pod
phases (a pod counts as active from admission until ``release``), and the
checkpoint's checksum.
"""

from __future__ import annotations

import json
import logging
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from agent.emulators.podresources import NO_NUMA, DeviceState, PodResourcesServer
from agent.emulators.pods import CORE_RESOURCE, PodSpec
from agent.errors import VcudaError
from agent.platform.kubelet.channel import API_VERSION, rpc_error_parts, unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHECKPOINT = "kubelet_internal_checkpoint"
_Response = TypeVar("_Response")
HEALTHY = "Healthy"


class AdmissionError(VcudaError):
    """kubelet would fail the pod with UnexpectedAdmissionError."""


@dataclass
class ContainerAdmission:
    container: str
    device_ids: list[str]
    preferred: list[str] | None
    response: pb.ContainerAllocateResponse


@dataclass
class PodAdmission:
    pod: PodSpec
    containers: list[ContainerAdmission] = field(default_factory=list)


class PluginConnection:
    """kubelet's side of one registered plugin: its options and its device list."""

    def __init__(self, request: pb.RegisterRequest, directory: Path, on_update: Callable[[], None]) -> None:
        self.request = request
        self.resource = request.resource_name
        self.channel = grpc.insecure_channel(unix_target(directory / request.endpoint))
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.options = self.stub.GetDevicePluginOptions(pb.Empty(), timeout=5, wait_for_ready=True)
        self.devices: dict[str, pb.Device] = {}
        self.updates: list[float] = []  # monotonic time of each ListAndWatch response
        self.stream_ended = False
        self._on_update = on_update
        self._stream = self.stub.ListAndWatch(pb.Empty())
        self._thread = threading.Thread(target=self._consume, name=f"law-{self.resource}", daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for response in self._stream:
                self.devices = {d.ID: d for d in response.devices}
                self.updates.append(time.monotonic())
                self._on_update()
        except grpc.RpcError as err:
            code, detail = rpc_error_parts(err)
            if code is not grpc.StatusCode.CANCELLED:
                log.info("ListAndWatch for %s ended: %s", self.resource, detail)
        self.stream_ended = True
        self._on_update()

    def healthy_ids(self) -> list[str]:
        return sorted(i for i, d in self.devices.items() if d.health == HEALTHY and not self.stream_ended)

    def close(self) -> None:
        cancel = getattr(self._stream, "cancel", None)
        if cancel is not None:
            cancel()
        self.channel.close()
        self._thread.join(timeout=5)


class KubeletEmulator(pb_grpc.RegistrationServicer):
    """kubelet's device manager (and, optionally, its pod-resources API) on real unix sockets."""

    def __init__(
        self, directory: Path, pod_resources_socket: Path | None = None, serve_get: bool = True
    ) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.registrations: list[pb.RegisterRequest] = []
        self.plugins: dict[str, PluginConnection] = {}
        self.allocated: dict[tuple[str, str, str], list[str]] = {}  # (pod uid, container, resource) -> IDs
        self.pods: dict[str, PodSpec] = {}  # admitted pods by uid, in admission order
        self._numa: dict[str, int] = {}  # device ID -> NUMA node, as the plugin listed it
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._changed = threading.Condition()
        self.pod_resources = (
            PodResourcesServer(pod_resources_socket, self._device_state, serve_get)
            if pod_resources_socket is not None
            else None
        )

    # Lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet-emu")
        self._server = grpc.server(self._executor)
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(unix_target(self.socket))
        self._server.start()
        if self.pod_resources is not None:
            self.pod_resources.start()

    def stop(self) -> None:
        if self.pod_resources is not None:
            self.pod_resources.stop()
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        with self._changed:
            plugins, self.plugins = list(self.plugins.values()), {}
        for plugin in plugins:
            plugin.close()

    def restart(self) -> None:
        """What a kubelet restart does to the device-plugin directory."""
        self.stop()
        for entry in self.directory.iterdir():
            if entry.name != CHECKPOINT and stat.S_ISSOCK(entry.lstat().st_mode):
                entry.unlink(missing_ok=True)
        self.start()

    # Registration service --------------------------------------------------
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if request.version != API_VERSION:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported device plugin API version {request.version!r}",
            )
        if "/" not in request.resource_name:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid extended resource name {request.resource_name!r}",
            )
        with self._changed:
            self.registrations.append(request)
        # kubelet connects back to the plugin asynchronously, after Register returns.
        threading.Thread(target=self._connect, args=(request,), name="kubelet-connect", daemon=True).start()
        return pb.Empty()

    def _connect(self, request: pb.RegisterRequest) -> None:
        try:
            plugin = PluginConnection(request, self.directory, self._notify)
        except grpc.RpcError as err:
            log.warning("cannot connect to plugin %s: %s", request.resource_name, err)
            return
        with self._changed:
            old = self.plugins.get(plugin.resource)
            self.plugins[plugin.resource] = plugin
            self._changed.notify_all()
        if old is not None:
            old.close()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout=timeout_s)

    def wait_for_plugin(self, resource: str = CORE_RESOURCE, timeout_s: float = 10.0) -> PluginConnection:
        def ready() -> bool:
            plugin = self.plugins.get(resource)
            return plugin is not None and bool(plugin.updates)

        if not self.wait_for(ready, timeout_s):
            raise AdmissionError(
                f"no plugin for {resource} registered and listed devices within {timeout_s} s"
            )
        return self.plugins[resource]

    # Admission -------------------------------------------------------------
    def in_use(self, resource: str) -> set[str]:
        with self._changed:
            return {i for (_, _, r), ids in self.allocated.items() if r == resource for i in ids}

    def admit(self, pod: PodSpec, resource: str = CORE_RESOURCE) -> PodAdmission:
        self._plugin(resource)
        admission = PodAdmission(pod)
        self._register(pod)
        try:
            for container in pod.containers:
                if container.cores <= 0:
                    continue
                step = self.allocate(pod, container.name, resource)
                self.pre_start(step.device_ids, resource)
                admission.containers.append(step)
                if container.init:
                    with self._changed:
                        self.allocated.pop((pod.uid, container.name, resource), None)
        except (AdmissionError, grpc.RpcError):
            self.release(pod)
            raise
        self._write_checkpoint()
        return admission

    def allocate(self, pod: PodSpec, container: str, resource: str = CORE_RESOURCE) -> ContainerAdmission:
        """One step of ``admit``, for tests that stop between steps: the pod becomes known (to
        pod-resources too), the container's IDs are chosen and recorded, and ``Allocate``
        returns; no ``PreStartContainer`` yet."""
        plugin = self._plugin(resource)
        spec = next((c for c in pod.containers if c.name == container), None)
        if spec is None or spec.cores <= 0:
            raise AdmissionError(f"pod {pod.key} has no container {container!r} that asks for {resource}")
        if self.pods.get(pod.uid) is not pod:
            self._register(pod)
        return self._admit_container(plugin, pod, container, spec.cores)

    def pre_start(self, device_ids: list[str], resource: str = CORE_RESOURCE) -> None:
        """The step after ``allocate``: ``PreStartContainer`` when the plugin asks for it."""
        plugin = self._plugin(resource)
        if plugin.options.pre_start_required:
            _call(plugin.stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=device_ids))

    def _plugin(self, resource: str) -> PluginConnection:
        plugin = self.plugins.get(resource)
        if plugin is None:
            raise AdmissionError(f"no device plugin registered for {resource}")
        return plugin

    def _register(self, pod: PodSpec) -> None:
        with self._changed:  # kubelet's pod manager knows the pod before admission starts
            self.pods.pop(pod.uid, None)
            self.pods[pod.uid] = pod

    def _admit_container(
        self, plugin: PluginConnection, pod: PodSpec, name: str, needed: int
    ) -> ContainerAdmission:
        available = [i for i in plugin.healthy_ids() if i not in self.in_use(plugin.resource)]
        if len(available) < needed:
            raise AdmissionError(
                f"requested number of devices unavailable for {plugin.resource}. "
                f"Requested: {needed}, Available: {len(available)}"
            )
        preferred = None
        chosen = available[:needed]
        if plugin.options.get_preferred_allocation_available:
            request = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=needed
                    )
                ]
            )
            preferred = list(
                _call(plugin.stub.GetPreferredAllocation, request).container_responses[0].deviceIDs
            )
            if len(preferred) == needed and set(preferred) <= set(available):
                chosen = preferred
        with self._changed:
            self.allocated[(pod.uid, name, plugin.resource)] = chosen
            for device_id in chosen:
                self._numa[device_id] = _numa_node(plugin.devices.get(device_id))
        allocate = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)])
        response = _call(plugin.stub.Allocate, allocate).container_responses[0]
        return ContainerAdmission(name, chosen, preferred, response)

    def release(self, pod: PodSpec) -> None:
        """The pod ended or was deleted: its devices are free and pod-resources forgets it."""
        with self._changed:
            for key in [k for k in self.allocated if k[0] == pod.uid]:
                del self.allocated[key]
            self.pods.pop(pod.uid, None)
        self._write_checkpoint()

    def _device_state(self) -> DeviceState:
        with self._changed:
            allocatable = {r: p.healthy_ids() for r, p in self.plugins.items()}
            numa = dict(self._numa)
            for plugin in self.plugins.values():
                numa.update({i: _numa_node(d) for i, d in plugin.devices.items()})
            return DeviceState(
                pods=list(self.pods.values()),
                allocated={k: list(v) for k, v in self.allocated.items()},
                numa=numa,
                allocatable=allocatable,
            )

    def _write_checkpoint(self) -> None:
        with self._changed:
            allocated = sorted(self.allocated.items())
        entries = [
            {"PodUID": uid, "ContainerName": c, "ResourceName": r, "DeviceIDs": {"-1": ids}}
            for (uid, c, r), ids in allocated
        ]
        (self.directory / CHECKPOINT).write_text(
            json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 0})
        )


def _numa_node(device: pb.Device | None) -> int:
    nodes = device.topology.nodes if device is not None else []
    return nodes[0].ID if nodes else NO_NUMA


def _call(method: Callable[..., _Response], request: object) -> _Response:
    try:
        return method(request, timeout=30)
    except grpc.RpcError as err:
        raise AdmissionError(f"UnexpectedAdmissionError: {rpc_error_parts(err)[1]}") from err
