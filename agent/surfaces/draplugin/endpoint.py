"""Serving the DRA plugin's sockets and staying registered with kubelet's plugin watcher.

Two sockets, as kubelet's own DRA helper lays them out: the registration service
(``pluginregistration.Registration``) in kubelet's plugins_registry directory, which kubelet's
plugin watcher dials when the socket appears (and again for every socket there when kubelet
starts), and the DRA service at the endpoint GetInfo names. kubelet never deletes these
sockets on a restart; whatever does (a wiped registry directory, a re-created hostPath) is
repaired here: the registry directory is watched with inotify and both sockets are checked
every tick, and a socket that is gone or no longer ours is served again (kubelet then
registers the plugin anew). Registration state comes from kubelet's NotifyRegistrationStatus.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.domain.dra import DRA_SERVICES, DRIVER, PLUGIN_TYPE
from agent.errors import KubeletError, PlatformError
from agent.platform.inotify import DirectoryWatch
from agent.platform.kubelet.channel import unix_target
from agent.platform.kubelet.pb import pluginregistration_v1_pb2 as reg
from agent.platform.kubelet.pb import pluginregistration_v1_pb2_grpc as reg_grpc
from agent.platform.threadname import set_native_name
from agent.settings import DraSettings
from agent.surfaces.draplugin.preparer import ClaimPreparer
from agent.surfaces.draplugin.service import add_dra_services

log = logging.getLogger(__name__)

_WATCH_TICK_S = 0.2  # how soon a removed socket is served again, and how long stop() waits


@dataclass(frozen=True)
class DraEndpointStatus:
    serving: bool
    registered: bool  # kubelet's last NotifyRegistrationStatus said so
    registrations: int  # successful registrations kubelet notified since start
    restarts: int  # times a socket was served again
    last_error: str  # kubelet's last registration error, or why a socket could not be served


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: DraPluginEndpoint) -> None:
        self._endpoint = endpoint

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER,
            endpoint=str(self._endpoint.settings.dra_socket),
            supported_versions=list(DRA_SERVICES),
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self._endpoint.notified(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


@dataclass
class _Served:
    server: grpc.Server
    executor: ThreadPoolExecutor
    socket: Path
    identity: tuple[int, int]  # (st_dev, st_ino) of the socket file this server created

    def is_ours(self) -> bool:
        try:
            stat = os.stat(self.socket)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self.identity

    def shutdown(self) -> None:
        self.server.stop(grace=None).wait(5)
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.is_ours():
            self.socket.unlink(missing_ok=True)


class DraPluginEndpoint:
    """``start()`` serves both sockets and watches them; ``stop()`` removes them (kubelet then
    deregisters the plugin, as it should while the agent is down)."""

    def __init__(self, settings: DraSettings, preparer: ClaimPreparer, max_workers: int = 8) -> None:
        self.settings = settings
        self._preparer = preparer
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._dra: _Served | None = None
        self._registration: _Served | None = None
        self._registered = False
        self._registrations = 0
        self._restarts = 0
        self._last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self) -> DraEndpointStatus:
        with self._lock:
            return DraEndpointStatus(
                self._dra is not None and self._registration is not None,
                self._registered,
                self._registrations,
                self._restarts,
                self._last_error,
            )

    def start(self) -> None:
        """Serve both sockets (KubeletError if either cannot be) and start watching them."""
        self._stop.clear()
        # The DRA socket first: kubelet may call it as soon as it has read GetInfo.
        self._dra = self._serve(self.settings.dra_socket, "dra-rpc", self._add_dra)
        self._registration = self._serve(self.settings.registration_socket, "dra-reg", self._add_registration)
        self._thread = threading.Thread(target=self._watch_loop, name="dra-endpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            served, self._registration, self._dra = [self._registration, self._dra], None, None
            self._registered = False
        for item in served:  # registration first: kubelet stops using the plugin before the DRA socket goes
            if item is not None:
                item.shutdown()

    def notified(self, registered: bool, error: str) -> None:
        with self._lock:
            self._registered = registered
            if registered:
                self._registrations += 1
                self._last_error = ""
            else:
                self._last_error = f"kubelet refused the registration: {error}"
        if registered:
            log.info("kubelet registered DRA driver %s (%s)", DRIVER, self.settings.dra_socket)
        else:
            log.error("kubelet refused DRA driver %s: %s", DRIVER, error)

    # Serving -------------------------------------------------------------------------------
    def _add_dra(self, server: grpc.Server) -> None:
        add_dra_services(server, self._preparer)

    def _add_registration(self, server: grpc.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)

    def _serve(self, socket: Path, name: str, add: Callable[[grpc.Server], None]) -> _Served:
        try:
            socket.parent.mkdir(parents=True, exist_ok=True)
            socket.unlink(missing_ok=True)  # a previous agent's: grpc cannot bind over it
        except OSError as err:
            raise KubeletError(f"cannot prepare {socket}: {err}") from err
        executor = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=name)
        server = grpc.server(executor)
        add(server)
        if server.add_insecure_port(unix_target(socket)) == 0:
            executor.shutdown(wait=False)
            raise KubeletError(f"cannot listen on {socket}")
        server.start()
        stat = os.stat(socket)
        log.info("serving DRA driver %s on %s", DRIVER, socket)
        return _Served(server, executor, socket, (stat.st_dev, stat.st_ino))

    # Watching ------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        set_native_name(threading.current_thread().name)  # per-thread CPU and wakeups name it
        watch = self._open_watch()
        try:
            while not self._stop.is_set():
                events = watch.read(_WATCH_TICK_S) if watch is not None else []
                if watch is None or any(e.watch_gone for e in events):
                    if watch is not None:
                        watch.close()
                    watch = self._open_watch()
                if not self._stop.is_set():
                    self._repair()
        finally:
            if watch is not None:
                watch.close()

    def _repair(self) -> None:
        with self._lock:
            dra, registration = self._dra, self._registration
        if dra is not None and not dra.is_ours():
            log.info("the DRA socket %s was removed: serving it again", dra.socket)
            self._replace(dra, "dra-rpc", self._add_dra, registration=False)
        if registration is not None and not registration.is_ours():
            log.info("the registration socket %s was removed: serving it again", registration.socket)
            self._replace(registration, "dra-reg", self._add_registration, registration=True)

    def _replace(
        self, old: _Served, name: str, add: Callable[[grpc.Server], None], *, registration: bool
    ) -> None:
        old.shutdown()
        try:
            new = self._serve(old.socket, name, add)
        except (KubeletError, OSError) as err:
            with self._lock:
                self._last_error = str(err)
            log.error("cannot serve %s again: %s", old.socket, err)
            return
        with self._lock:
            if self._stop.is_set():
                new.shutdown()
                return
            if registration:
                self._registration = new
                self._registered = False  # until kubelet's plugin watcher has registered it anew
            else:
                self._dra = new
            self._restarts += 1

    def _open_watch(self) -> DirectoryWatch | None:
        try:
            self.settings.registry_dir.mkdir(parents=True, exist_ok=True)
            return DirectoryWatch(self.settings.registry_dir)
        except (OSError, PlatformError) as err:
            log.warning("%s; checking the sockets every %.1f s instead", err, _WATCH_TICK_S)
            self._stop.wait(_WATCH_TICK_S)
            return None
