"""Metrics built at scrape time from the agent's state (no counters kept on the side)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from agent import __version__
from agent.domain.health import GpuHealth
from agent.domain.visibledevices import HoleState
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.deviceplugin.endpoint import EndpointStatus

_MIB = 1024 * 1024


class AgentView(Protocol):
    """What the collector reads from the running agent."""

    node_name: str
    backend_name: str

    def gpu_list(self) -> Sequence[GpuInfo]: ...

    def gpu_health(self) -> dict[int, GpuHealth]: ...

    def gpu_degraded(self) -> dict[int, str]: ...

    def call_timeouts(self) -> dict[tuple[int, str], int]: ...

    def endpoint_status(self) -> EndpointStatus: ...

    def visible_devices_hole(self) -> tuple[str, str]: ...


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
        degraded = GaugeMetricFamily(
            "vcuda_gpu_degraded",
            "1 while a backend (NVML) call on the GPU is stuck past its deadline",
            labels=labels,
        )
        timeouts = CounterMetricFamily(
            "vcuda_gpu_call_timeouts",
            "Backend (NVML) calls on the GPU that did not return within their deadline",
            labels=[*labels, "call"],
        )
        health = view.gpu_health()
        stuck = view.gpu_degraded()
        gpus = {gpu.index: gpu for gpu in view.gpu_list()}
        for gpu in gpus.values():
            values = [node, str(gpu.index), gpu.uuid, gpu.model]
            healthy.add_metric(values, 1.0 if health[gpu.index].healthy else 0.0)
            memory.add_metric(values, float(gpu.memory_mib * _MIB))
            degraded.add_metric(values, 1.0 if gpu.index in stuck else 0.0)
        for (index, call), count in sorted(view.call_timeouts().items()):
            gpu = gpus[index]
            timeouts.add_metric([node, str(index), gpu.uuid, gpu.model, call], float(count))
        yield healthy
        yield memory
        yield degraded
        yield timeouts
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
        hole = GaugeMetricFamily(
            "vcuda_nvidia_visible_devices_hole",
            "1 for whether a pod's own NVIDIA_VISIBLE_DEVICES gets every GPU from the NVIDIA runtime "
            "(open, closed, unknown), from the toolkit's config.toml",
            labels=["node", "state"],
        )
        current = view.visible_devices_hole()[0]
        for state in (s.value for s in HoleState):
            hole.add_metric([node, state], 1.0 if state == current else 0.0)
        yield hole
