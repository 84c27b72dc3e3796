"""Sharing metrics at scrape time: the MPS control daemons per GPU, and what holds each
container's compute share and memory quota."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.control.mpssharing import MpsSharing
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.mpsdaemon import DaemonState
from agent.surfaces.enforcementnode import EnforcementIntegration
from agent.surfaces.metrics.families import CONTAINER_LABELS, container_labels

DAEMON_LABELS = ["node", "gpu", "uuid"]


class SharingCollector(Collector):
    def __init__(
        self,
        sharing: MpsSharing,
        enforcement: EnforcementIntegration | None,
        gpus: Sequence[GpuInfo],
        node_name: str,
    ) -> None:
        self._sharing = sharing
        self._enforcement = enforcement
        self._gpus = {g.index: g for g in gpus}
        self._node = node_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "vcuda_mps_daemon_up",
            "1 while the GPU's MPS control daemon runs and its control socket is up (absent: none started)",
            labels=DAEMON_LABELS,
        )
        restarts = CounterMetricFamily(
            "vcuda_mps_daemon_restarts",
            "Times the GPU's MPS control daemon died and was restarted",
            labels=DAEMON_LABELS,
        )
        for status in self._sharing.daemon_statuses():
            if status.state is DaemonState.STOPPED and not status.restarts:
                continue
            labels = [self._node, str(status.gpu), status.uuid]
            up.add_metric(labels, 1.0 if status.state is DaemonState.RUNNING else 0.0)
            restarts.add_metric(labels, float(status.restarts))
        yield up
        yield restarts
        advisory = GaugeMetricFamily(
            "vcuda_mps_limits_advisory",
            "1 while the GPU's shares run under MPS limits a tenant can lift (mpsAdvisoryLimits), "
            "0 otherwise (freezer, or limits the tenant cannot change)",
            labels=DAEMON_LABELS,
        )
        for index, gpu in sorted(self._gpus.items()):
            advisory.add_metric(
                [self._node, str(index), gpu.uuid], 1.0 if self._sharing.advisory(index) else 0.0
            )
        yield advisory
        if self._enforcement is None:
            return
        held = GaugeMetricFamily(
            "vcuda_container_held_by_info",
            "1 per container: what holds its compute share (compute) and its memory quota (memory)",
            labels=[*CONTAINER_LABELS, "compute", "memory"],
        )
        for control in self._enforcement.enforcer.controls():
            compute, _ = self._enforcement.compute_holder(control)
            memory, _ = self._enforcement.memory_holder(control.spec)
            names = container_labels(self._node, control.spec)
            held.add_metric([*(names[name] for name in CONTAINER_LABELS), compute, memory], 1.0)
        yield held
