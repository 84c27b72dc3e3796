"""Metrics built at scrape time from the agent's state (no counters kept on the side)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from agent import __version__
from agent.domain.health import GpuHealth
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.deviceplugin.endpoint import EndpointStatus

_MIB = 1024 * 1024


class AgentView(Protocol):
    """What the collector reads from the running agent."""

    node_name: str
    backend_name: str

    def gpu_list(self) -> Sequence[GpuInfo]: ...

    def gpu_health(self) -> dict[int, GpuHealth]: ...

    def endpoint_status(self) -> EndpointStatus: ...


class AgentCollector(Collector):
    def __init__(self, view: AgentView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        view = self._view
        node = view.node_name
        yield InfoMetricFamily(
            "vcuda_build",
            "vcuda-agent build",
            value={"version": __version__, "backend": view.backend_name},
        )
        labels = ["node", "gpu", "uuid", "model"]
        healthy = GaugeMetricFamily(
            "vcuda_gpu_healthy", "1 when the GPU is Healthy, 0 when Unhealthy", labels=labels
        )
        memory = GaugeMetricFamily("vcuda_gpu_memory_total_bytes", "GPU memory", labels=labels)
        health = view.gpu_health()
        for gpu in view.gpu_list():
            values = [node, str(gpu.index), gpu.uuid, gpu.model]
            healthy.add_metric(values, 1.0 if health[gpu.index].healthy else 0.0)
            memory.add_metric(values, float(gpu.memory_mib * _MIB))
        yield healthy
        yield memory
        status = view.endpoint_status()
        registered = GaugeMetricFamily(
            "vcuda_kubelet_registered", "1 while registered with kubelet", labels=["node"]
        )
        registered.add_metric([node], 1.0 if status.registered else 0.0)
        yield registered
        registrations = CounterMetricFamily(
            "vcuda_kubelet_registrations", "Successful registrations with kubelet", labels=["node"]
        )
        registrations.add_metric([node], float(status.registrations))
        yield registrations
