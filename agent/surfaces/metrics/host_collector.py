"""Host-side metrics at scrape time: eBPF status, the device guard's and the gate's counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.surfaces.hostnode import HostIntegration

BPF_STATUSES = ("ok", "no-bcc", "not-permitted", "no-headers", "no-tracefs", "load-failed", "off", "starting")


class HostCollector(Collector):
    def __init__(self, host: HostIntegration, node_name: str) -> None:
        self._host = host
        self._node = node_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        node = self._node
        status = GaugeMetricFamily(
            "vcuda_bpf_status",
            "1 for the eBPF ioctl tracer's state (ok: attached; otherwise the agent runs on NVML alone)",
            labels=["node", "status"],
        )
        current = self._host.bpf_status()
        for name in BPF_STATUSES:
            status.add_metric([node, name], 1.0 if name == current else 0.0)
        yield status
        guard = self._host.guard
        if guard is None:
            return
        stats = guard.stats()
        labels = ["node", "mode", "mechanism"]
        values = [node, stats.mode.value, stats.mechanism]
        guarded = GaugeMetricFamily(
            "vcuda_device_guard_containers",
            "Containers whose NVIDIA device rules are in place",
            labels=labels,
        )
        guarded.add_metric(values, float(stats.guarded))
        yield guarded
        pending = GaugeMetricFamily(
            "vcuda_device_guard_pending_containers", "Containers whose cgroup is not there yet", labels=labels
        )
        pending.add_metric(values, float(stats.pending))
        yield pending
        for name, help_text, value in (
            (
                "vcuda_device_guard_reattachments",
                "Device rules repaired after a runtime removed them",
                stats.reattachments,
            ),
            ("vcuda_device_guard_errors", "Failed attempts to apply device rules", stats.errors),
        ):
            counter = CounterMetricFamily(name, help_text, labels=labels)
            counter.add_metric(values, float(value))
            yield counter
        gate = self._host.gate
        if gate is not None:
            gate_stats = gate.stats()
            gated = GaugeMetricFamily(
                "vcuda_device_gate_pods", "Pod cgroups holding the device gate's rules", labels=labels
            )
            gated.add_metric(values, float(gate_stats.gated))
            yield gated
            errors = CounterMetricFamily(
                "vcuda_device_gate_errors", "Failed attempts to put rules on a pod's cgroup", labels=labels
            )
            errors.add_metric(values, float(gate_stats.errors))
            yield errors
