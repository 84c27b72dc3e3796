"""Which container holds which MIG device, for the device guard: the device nodes it may open.

A MIG device plugin's Allocate does not say which pod it is for; kubelet's pod-resources
API does, by namespace, pod and container, with the device IDs (MIG UUIDs) of each resource.
Those of the MIG resources this agent serves are joined to the pod cache (for the pod's
UID) and to the MIG offer (for each device's parent GPU minor and its GPU instance and
compute instance capability minors). Read again when ``ttl_s`` has passed or an Allocate
happened since (``invalidate``); while kubelet cannot be asked the last answer stands
(none before the first: the guard then allows such a container no NVIDIA device).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.clock import Clock, SystemClock
from agent.control.kubeports import DeviceRecord, DeviceTruth, PodSource
from agent.control.migoffers import MigOffers
from agent.control.retrylog import RetryLog
from agent.errors import VcudaError
from agent.settings import MIG_HOLDINGS_TTL_S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigGrant:
    """The device nodes a container's MIG devices need besides nvidiactl and UVM."""

    gpu_minors: frozenset[int]  # the parent GPUs' /dev/nvidiaN
    cap_minors: frozenset[int]  # /dev/nvidia-caps/nvidia-cap<minor>: each device's GI and CI access


class MigHoldings:
    def __init__(
        self,
        truth: DeviceTruth,
        pods: PodSource,
        offers: MigOffers,
        resources: Callable[[], frozenset[str]],
        *,
        ttl_s: float = MIG_HOLDINGS_TTL_S,
        clock: Clock | None = None,
    ) -> None:
        """``resources``: the MIG resources served now."""
        self._truth = truth
        self._pods = pods
        self._offers = offers
        self._resources = resources
        self._ttl_s = ttl_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._grants: dict[tuple[str, str], MigGrant] = {}
        self._read_at: float | None = None
        self._retry = RetryLog(log, "cannot read which pods hold MIG devices", "pod-resources answers again")

    def invalidate(self) -> None:
        """An Allocate happened: the next ``grants()`` asks kubelet again."""
        with self._lock:
            self._read_at = None

    def grants(self) -> Mapping[tuple[str, str], MigGrant]:
        """(pod UID, container) -> its MIG devices' nodes."""
        with self._lock:
            fresh = self._read_at is not None and self._clock.monotonic() - self._read_at < self._ttl_s
            if fresh:
                return dict(self._grants)
        resources = self._resources()
        if not resources:
            grants: dict[tuple[str, str], MigGrant] = {}
        else:
            try:
                records = [r for r in self._truth.list() if r.resource in resources]
            except VcudaError as err:
                self._retry.failed(str(err))
                with self._lock:
                    return dict(self._grants)
            self._retry.succeeded()
            grants = self._join(records)
        with self._lock:
            self._grants, self._read_at = grants, self._clock.monotonic()
            return dict(grants)

    def _join(self, records: Sequence[DeviceRecord]) -> dict[tuple[str, str], MigGrant]:
        _, offer = self._offers.current()
        by_id = {d.id: d for devices in offer.resources.values() for d in devices}
        found: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
        for record in records:
            pod = self._pods.find(record.namespace, record.pod)
            if pod is None:
                continue
            gpus, caps = found.setdefault((pod.uid, record.container), (set(), set()))
            for device_id in record.device_ids:
                offered = by_id.get(device_id)
                if offered is None:
                    continue  # gone since (a geometry changed): nothing to allow
                gpus.add(offered.gpu.minor)
                minors = (offered.device.gi_cap_minor, offered.device.ci_cap_minor)
                caps.update(m for m in minors if m is not None)
        return {key: MigGrant(frozenset(g), frozenset(c)) for key, (g, c) in found.items()}


Grants = Callable[[], Mapping[tuple[str, str], MigGrant]]


def merged_grants(*sources: Grants) -> Grants:
    """One grants source of several (the MIG plugins' holdings, isolated shares...): a
    container in more than one is allowed the nodes of all."""

    def grants() -> dict[tuple[str, str], MigGrant]:
        out: dict[tuple[str, str], MigGrant] = {}
        for source in sources:
            for key, grant in source().items():
                before = out.get(key, MigGrant(frozenset(), frozenset()))
                gpus, caps = before.gpu_minors | grant.gpu_minors, before.cap_minors | grant.cap_minors
                out[key] = MigGrant(gpus, caps)
        return out

    return grants
