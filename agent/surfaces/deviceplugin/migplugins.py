"""One kubelet device plugin per MIG resource the node offers, each served and registered as
the vcuda-core plugin is (``endpoint.py``: its own unix socket in kubelet's device-plugin
directory, ``vcuda-mig-<profile>.sock`` or ``vcuda-mig-gpu.sock``, re-served and registered
again when kubelet restarts).

The set follows the MIG offer: a resource that appears (a geometry applied, the strategy
changed) gets its plugin started, one that is gone has its plugin stopped (its socket
removed: kubelet then stops offering it). ``run()`` syncs on every offer change.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from agent.control.migoffers import MigOffers
from agent.errors import KubeletError
from agent.settings import MIG_OFFER_POLL_S, DevicePluginSettings
from agent.surfaces.deviceplugin.endpoint import EndpointStatus, PluginEndpoint
from agent.surfaces.deviceplugin.migservice import MigPluginService
from agent.surfaces.deviceplugin.responses import ResponseBuilder

log = logging.getLogger(__name__)


def socket_name(resource: str) -> str:
    """``vcuda-mig-3g.40gb.sock`` for ``nvidia.com/mig-3g.40gb``, ``vcuda-mig-gpu.sock`` for
    ``nvidia.com/gpu``."""
    name = resource.partition("/")[2].removeprefix("mig-")
    return f"vcuda-mig-{name}.sock"


class MigPlugins:
    def __init__(
        self,
        settings: DevicePluginSettings,
        offers: MigOffers,
        responses: ResponseBuilder,
        on_allocate: Callable[[], None] = lambda: None,
    ) -> None:
        self._settings = settings
        self._offers = offers
        self._responses = responses
        self._on_allocate = on_allocate
        self._lock = threading.Lock()
        self._endpoints: dict[str, PluginEndpoint] = {}
        self._stopped = False
        # GPUs whose MIG instances serve isolated shares (mig.onDemand): never offered here.
        self.exclude: Callable[[], frozenset[int]] = frozenset

    def resources(self) -> frozenset[str]:
        """The MIG resources served now."""
        with self._lock:
            return frozenset(self._endpoints)

    def statuses(self) -> dict[str, EndpointStatus]:
        with self._lock:
            endpoints = dict(self._endpoints)
        return {resource: endpoint.status() for resource, endpoint in endpoints.items()}

    def sync(self) -> None:
        """Start the plugins of new resources, stop those of resources gone."""
        _, offer = self._offers.current()
        excluded = self.exclude()
        wanted = {
            r for r, devices in offer.resources.items() if any(d.gpu.index not in excluded for d in devices)
        }
        with self._lock:
            if self._stopped:
                return
            current = set(self._endpoints)
        for resource in sorted(current - wanted):
            self._stop_one(resource)
            log.info("%s is no longer offered: its device plugin stopped", resource)
        for resource in sorted(wanted - current):
            settings = dataclasses.replace(
                self._settings, socket_name=socket_name(resource), resource_name=resource
            )
            service = MigPluginService(
                resource, self._offers, self._responses, self._on_allocate, self.exclude
            )
            endpoint = PluginEndpoint(settings, service)
            try:
                endpoint.start()
            except KubeletError as err:
                log.error("cannot serve %s: %s", resource, err)
                continue
            with self._lock:
                self._endpoints[resource] = endpoint

    def run(self, stop: threading.Event) -> None:
        seen = -1
        while not stop.is_set():
            self.sync()
            seen = self._offers.wait_for_change(seen, MIG_OFFER_POLL_S, abort=stop)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            resources = list(self._endpoints)
        for resource in resources:
            self._stop_one(resource)

    def _stop_one(self, resource: str) -> None:
        with self._lock:
            endpoint = self._endpoints.pop(resource, None)
        if endpoint is not None:
            endpoint.stop()
