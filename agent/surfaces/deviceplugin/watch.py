"""What every device plugin of the agent answers alike: its options, and ListAndWatch's
stream (the device list at once, then again each time it changes, until kubelet goes away).

The list is re-read when the plugin's source moves (health, the MIG offer: ``changes``) and
sent only if it differs from the last one sent; a stream ended by kubelet wakes the waiter
so that its thread is freed at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

WAIT_S = 5.0  # a stream looks at whether kubelet is still there this often

Wait = Callable[[int, float, threading.Event], int]  # (seen version, timeout, abort) -> version


class WatchedPlugin(pb_grpc.DevicePluginServicer):
    """A DevicePlugin service: subclasses give ``resource``, ``options``, ``device_list`` and
    ``changes``."""

    resource: str

    def options(self) -> pb.DevicePluginOptions:
        raise NotImplementedError

    def device_list(self) -> tuple[int, pb.ListAndWatchResponse]:
        """The version of the source the list was made from, and the list."""
        raise NotImplementedError

    def changes(self) -> tuple[Wait, Callable[[], None]]:
        """How to wait for the source to move past a version, and how to wake the waiters."""
        raise NotImplementedError

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self.options()

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        wait, wake = self.changes()
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            wake()

        context.add_callback(on_end)
        version, sent = self.device_list()
        yield sent
        while not ended.is_set() and context.is_active():
            new_version = wait(version, WAIT_S, ended)
            if new_version == version or ended.is_set():
                continue
            version, response = self.device_list()
            if response != sent:
                sent = response
                log.info("ListAndWatch %s: sending %d devices", self.resource, len(response.devices))
                yield response
