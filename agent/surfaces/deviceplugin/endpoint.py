"""Serving the device plugin on its socket and staying registered with kubelet.

kubelet restarts by deleting every socket in the device-plugin directory and
creating a new kubelet.sock. The endpoint watches the directory with inotify and,
within a second, serves a fresh gRPC server on its socket and registers again;
it does the same if only its own socket is deleted. Registration is retried
while kubelet is unreachable.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.errors import KubeletError, PlatformError
from agent.platform.inotify import DirectoryWatch
from agent.platform.kubelet.channel import API_VERSION, register_with_kubelet, unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent.platform.threadname import set_native_name
from agent.settings import DevicePluginSettings
from agent.surfaces.deviceplugin.watch import WatchedPlugin

log = logging.getLogger(__name__)

# While not registered (or without a watch), the loop looks again this often; registered, it
# sleeps until the directory changes or stop() wakes it.
_WATCH_TICK_S = 0.2


@dataclass(frozen=True)
class EndpointStatus:
    serving: bool
    registered: bool
    registrations: int  # successful Register calls since start
    restarts: int  # times the gRPC server was served again
    last_error: str


class PluginEndpoint:
    def __init__(
        self,
        settings: DevicePluginSettings,
        service: WatchedPlugin,
        max_workers: int = 8,
    ) -> None:
        self._settings = settings
        self._service = service
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._socket_id: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: DirectoryWatch | None = None  # the loop's, for stop() to wake
        self._lock = threading.Lock()
        self._registered = False
        self._registrations = 0
        self._restarts = -1  # the first serve is not a restart
        self._last_error = ""
        self._next_attempt = 0.0
        self._waiting_logged = False
        self._kubelet_seen: tuple[int, int] | None = None  # kubelet.sock (inode, ctime) we registered with

    def status(self) -> EndpointStatus:
        with self._lock:
            return EndpointStatus(
                self._server is not None,
                self._registered,
                self._registrations,
                self._restarts,
                self._last_error,
            )

    def start(self) -> None:
        directory = self._settings.directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise KubeletError(f"cannot create the device-plugin directory {directory}: {err}") from err
        self._serve()
        self._thread = threading.Thread(target=self._watch_loop, name="plugin-endpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._shutdown_server()
        if self._socket_is_ours():
            self._settings.socket_path.unlink(missing_ok=True)

    # Serving ---------------------------------------------------------------
    def _serve(self) -> None:
        self._shutdown_server()
        path = self._settings.socket_path
        path.unlink(missing_ok=True)
        executor = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="plugin-rpc")
        server = grpc.server(executor)
        pb_grpc.add_DevicePluginServicer_to_server(self._service, server)
        if server.add_insecure_port(unix_target(path)) == 0:
            executor.shutdown(wait=False)
            raise KubeletError(f"cannot listen on {path}")
        server.start()
        stat = os.stat(path)
        with self._lock:
            self._server, self._executor = server, executor
            self._socket_id = (stat.st_dev, stat.st_ino)
            self._restarts += 1
        log.info("serving %s on %s", self._settings.resource_name, path)

    def _shutdown_server(self) -> None:
        with self._lock:
            server, executor = self._server, self._executor
            self._server = self._executor = None
            self._registered = False
        if server is not None:
            server.stop(grace=None).wait(5)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _socket_is_ours(self) -> bool:
        try:
            stat = os.stat(self._settings.socket_path)
        except FileNotFoundError:
            return False
        return (stat.st_dev, stat.st_ino) == self._socket_id

    # Registration ----------------------------------------------------------
    def _register(self) -> None:
        self._next_attempt = time.monotonic() + self._settings.register_retry_s
        if not self._settings.kubelet_socket.exists():
            if not self._waiting_logged:
                log.info("waiting for kubelet: %s does not exist yet", self._settings.kubelet_socket)
                self._waiting_logged = True
            return
        kubelet_id = _identity(self._settings.kubelet_socket)
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self._settings.socket_name,
            resource_name=self._settings.resource_name,
            options=self._service.options(),
        )
        try:
            register_with_kubelet(self._settings.kubelet_socket, request)
        except KubeletError as err:
            log.warning("%s; retrying in %.0f s", err, self._settings.register_retry_s)
            with self._lock:
                self._last_error = str(err)
            return
        self._waiting_logged = False
        with self._lock:
            self._registered = True
            self._registrations += 1
            self._last_error = ""
            self._kubelet_seen = kubelet_id
        log.info("registered %s with kubelet", self._settings.resource_name)

    # Watching --------------------------------------------------------------
    def _watch_loop(self) -> None:
        set_native_name(threading.current_thread().name)  # per-thread CPU and wakeups name it
        watch = self._open_watch()
        self._register()
        try:
            while not self._stop.is_set():
                # Registered and served, only a change of the directory (our socket or
                # kubelet.sock removed, re-created) can call for anything.
                wait = None if self.status().registered else _WATCH_TICK_S
                events = watch.read(wait) if watch else []
                if watch is None or any(e.watch_gone for e in events):
                    if watch is not None:
                        watch.close()
                    watch = self._open_watch()
                if self._stop.is_set():
                    break
                self._react(any(e.created and e.name == "kubelet.sock" for e in events))
        finally:
            with self._lock:
                self._watch = None
            if watch is not None:
                watch.close()

    def _react(self, kubelet_created: bool) -> None:
        # One kubelet restart can arrive as several batches of events; the identity of
        # kubelet.sock (inode and ctime together: inodes alone are reused) tells
        # whether this kubelet already has our registration.
        kubelet_new = kubelet_created and _identity(self._settings.kubelet_socket) != self._kubelet_seen
        if not self._socket_is_ours():
            log.info(
                "our socket %s was removed: serving and registering again",
                self._settings.socket_path,
            )
            self._serve_again()
            self._register()
        elif kubelet_new:
            log.info("kubelet.sock was re-created (kubelet restarted): registering again")
            with self._lock:
                self._registered = False
            self._register()
        elif not self.status().registered and time.monotonic() >= self._next_attempt:
            self._register()

    def _serve_again(self) -> None:
        try:
            self._serve()
        except (KubeletError, OSError) as err:
            with self._lock:
                self._last_error = str(err)
            log.error("cannot serve the device plugin again: %s", err)

    def _open_watch(self) -> DirectoryWatch | None:
        try:
            watch = DirectoryWatch(self._settings.directory)
        except PlatformError as err:
            log.warning("%s; checking the directory every %.1f s instead", err, _WATCH_TICK_S)
            self._stop.wait(_WATCH_TICK_S)
            return None
        with self._lock:
            self._watch = watch
        if self._stop.is_set():
            watch.wake()  # stop() looked before the watch was there
        return watch


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_ctime_ns
