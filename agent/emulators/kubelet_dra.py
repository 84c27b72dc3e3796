"""An emulator of kubelet's plugin watcher and DRA manager (for the demo, tests and benchmarks).

It speaks the real plugin registration API and the DRA gRPC API from kubelet's side, over
real unix sockets. It watches the plugins_registry directory with inotify (and, at start, walks
it, as kubelet does for plugins already running), dials every socket that appears there, calls
``GetInfo``, checks the answer as kubelet's DRA plugin manager does (type ``DRAPlugin``, a
name, one of the services kubelet supports in ``supported_versions``: the first one the plugin
lists that kubelet also supports is chosen, so a plugin lists the newest first), and answers
``NotifyRegistrationStatus``. A socket deleted from the directory deregisters its plugin.
``prepare``/``unprepare`` call NodePrepareResources/NodeUnprepareResources of the chosen
service (v1, or v1beta1 when that is what was chosen; ``services=("v1beta1.DRAPlugin",)``
emulates a 1.32-1.33 kubelet) and check that every claim has an entry in the answer.
``container_cdi_ids`` is what kubelet hands one container from a prepared claim (its DRA
manager's ``cdiDevicesAsList``): the container's ``resources.claims[]`` entry may name a
request, and then only devices whose request names contain it (or that name none) are given;
without a request, all of them. A container can name only a main request, so a driver that
answers a subrequest name (``gpu/small``) leaves such a container without its device.
``restart()`` is a kubelet restart: the plugins are forgotten and the directory walked again;
``restart(wipe=True)`` also deletes the directory, as re-created host paths do.

Not emulated: pods, the claim info cache and its checkpoint (callers name the claims), CDI
resolution by the runtime, ResourceSlice wiping when a driver is gone, the health stream
(DRAResourceHealth), per-call metrics, timeouts other than a fixed one, and CSI/device
plugins registering through the same directory (they are refused as unknown types).
"""

from __future__ import annotations

import logging
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agent.domain.dra import DRA_SERVICES, PLUGIN_TYPE, ClaimRef
from agent.errors import KubeletError, PlatformError
from agent.platform.inotify import DirectoryWatch
from agent.platform.kubelet.channel import rpc_error_parts, unix_target
from agent.platform.kubelet.pb import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from agent.platform.kubelet.pb import pluginregistration_v1_pb2 as reg
from agent.platform.kubelet.pb import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
_TICK_S = 0.1
_MODULES: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}


@dataclass(frozen=True)
class Registration:
    """One socket kubelet dialled: what GetInfo said and kubelet's verdict."""

    socket: Path
    info: reg.PluginInfo | None
    service: str  # the chosen DRA service; "" when refused
    error: str  # "" when registered


@dataclass(frozen=True)
class PreparedDevice:
    requests: list[str]
    pool: str
    device: str
    cdi_ids: list[str]


@dataclass(frozen=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def container_cdi_ids(result: PrepareResult, request: str = "") -> list[str]:
    """The CDI device IDs kubelet gives a container whose ``resources.claims[]`` entry names
    this claim and ``request`` ("" when it names none), as kubelet's cdiDevicesAsList does."""
    return [
        cdi_id
        for device in result.devices
        if not request or not device.requests or request in device.requests
        for cdi_id in device.cdi_ids
    ]


class DraPluginConnection:
    """kubelet's side of one registered DRA plugin."""

    def __init__(self, name: str, endpoint: str, service: str, socket: Path) -> None:
        self.name, self.endpoint, self.service, self.socket = name, endpoint, service, socket
        self.channel = grpc.insecure_channel(unix_target(Path(endpoint)))
        self.messages, grpc_module = _MODULES[service]
        self.stub = grpc_module.DRAPluginStub(self.channel)

    def _claims(self, claims: Sequence[ClaimRef]) -> list[Any]:
        return [self.messages.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        request = self.messages.NodePrepareResourcesRequest(claims=self._claims(claims))
        answer = _call(self.stub.NodePrepareResources, request, f"NodePrepareResources ({self.name})")
        _check_all_answered(claims, answer.claims, "NodePrepareResources")
        return {
            uid: PrepareResult(
                [
                    PreparedDevice(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
                    for d in entry.devices
                ],
                entry.error,
            )
            for uid, entry in answer.claims.items()
        }

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        request = self.messages.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        answer = _call(self.stub.NodeUnprepareResources, request, f"NodeUnprepareResources ({self.name})")
        _check_all_answered(claims, answer.claims, "NodeUnprepareResources")
        return {uid: entry.error for uid, entry in answer.claims.items()}

    def close(self) -> None:
        self.channel.close()


class KubeletDraEmulator:
    def __init__(self, registry_dir: Path, services: Sequence[str] = DRA_SERVICES) -> None:
        self.registry_dir = registry_dir
        self.services = tuple(services)  # what this kubelet supports, newest first
        self.registrations: list[Registration] = []
        self.plugins: dict[str, DraPluginConnection] = {}  # by driver name
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        try:
            watch = DirectoryWatch(self.registry_dir)
        except PlatformError as err:
            raise KubeletError(f"kubelet emulator cannot watch {self.registry_dir}: {err}") from err
        for entry in sorted(self.registry_dir.iterdir()):  # plugins that were there before us
            self._on_created(entry)
        self._thread = threading.Thread(target=self._watch, args=(watch,), name="kubelet-dra", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._changed:
            plugins, self.plugins = list(self.plugins.values()), {}
        for plugin in plugins:
            plugin.close()

    def restart(self, wipe: bool = False) -> None:
        self.stop()
        if wipe:
            shutil.rmtree(self.registry_dir, ignore_errors=True)
        self.start()

    # Plugin watcher ------------------------------------------------------------------------
    def _watch(self, watch: DirectoryWatch) -> None:
        try:
            while not self._stop.is_set():
                for event in watch.read(_TICK_S):
                    path = self.registry_dir / event.name
                    if event.created:
                        self._on_created(path)
                    elif event.deleted:
                        self._deregister(path)
        finally:
            watch.close()

    def _on_created(self, path: Path) -> None:
        try:
            is_socket = stat.S_ISSOCK(path.lstat().st_mode)
        except OSError:
            return
        if is_socket and not path.name.startswith("."):  # kubelet skips hidden files too
            # kubelet registers each socket in its own goroutine: a plugin slow to answer
            # GetInfo holds up no other.
            threading.Thread(target=self._register, args=(path,), name="kubelet-dra-reg", daemon=True).start()

    def _register(self, socket: Path) -> None:
        with grpc.insecure_channel(unix_target(socket)) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg.InfoRequest(), timeout=CALL_TIMEOUT_S, wait_for_ready=True)
            except grpc.RpcError as err:
                self._record(Registration(socket, None, "", f"GetInfo failed: {rpc_error_parts(err)[1]}"))
                return
            service, error = self._validate(info)
            connection = None
            if not error:
                connection = DraPluginConnection(info.name, info.endpoint, service, socket)
            try:
                stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=CALL_TIMEOUT_S
                )
            except grpc.RpcError as err:
                log.warning("NotifyRegistrationStatus to %s failed: %s", socket, rpc_error_parts(err)[1])
        self._record(Registration(socket, info, service if not error else "", error), connection)

    def _validate(self, info: reg.PluginInfo) -> tuple[str, str]:
        if info.type != PLUGIN_TYPE:
            return "", f"no handler registered for plugin type: {info.type}"
        if not info.name:
            return "", "DRA driver name is empty"
        if not info.supported_versions:
            return "", "empty list of supported gRPC services (aka supported versions)"
        chosen = next((s for s in info.supported_versions if s in self.services), "")
        if not chosen:
            return "", (
                f"none of services supported by the plugin ({list(info.supported_versions)}) "
                f"are supported by the kubelet ({list(self.services)})"
            )
        with self._changed:
            old = self.plugins.get(info.name)
        if old is not None and old.endpoint == info.endpoint and old.socket.exists():
            return "", f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
        return chosen, ""

    def _record(self, registration: Registration, connection: DraPluginConnection | None = None) -> None:
        with self._changed:
            self.registrations.append(registration)
            old = None
            if connection is not None:
                old = self.plugins.get(connection.name)
                self.plugins[connection.name] = connection
            self._changed.notify_all()
        if old is not None:
            old.close()

    def _deregister(self, socket: Path) -> None:
        with self._changed:
            gone = [name for name, p in self.plugins.items() if p.socket == socket]
            closed = [self.plugins.pop(name) for name in gone]
            self._changed.notify_all()
        for plugin in closed:
            plugin.close()

    # DRA calls -----------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout=timeout_s)

    def wait_for_plugin(self, driver: str, timeout_s: float = 10.0) -> DraPluginConnection:
        if not self.wait_for(lambda: driver in self.plugins, timeout_s):
            raise KubeletError(f"DRA driver {driver} is not registered (after {timeout_s} s)")
        return self.plugins[driver]

    def plugin(self, driver: str) -> DraPluginConnection:
        with self._changed:
            plugin = self.plugins.get(driver)
        if plugin is None:
            raise KubeletError(f"DRA driver {driver} is not registered")
        return plugin

    def prepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        return self.plugin(driver).prepare(claims)

    def unprepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, str]:
        return self.plugin(driver).unprepare(claims)


def _call(method: Callable[..., Any], request: object, what: str) -> Any:
    try:
        return method(request, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
    except grpc.RpcError as err:
        code, detail = rpc_error_parts(err)
        raise KubeletError(f"{what} failed ({code.name}): {detail}") from err


def _check_all_answered(claims: Sequence[ClaimRef], answered: Any, rpc: str) -> None:
    missing = [c.key for c in claims if c.uid not in answered]
    if missing:  # kubelet treats these as not done and calls again
        raise KubeletError(f"{rpc}: the plugin gave no answer for claims {missing}")
