"""gpu-manager's metric names and units, for users migrating dashboards (--legacy-metrics):
utilization in percent, memory in MiB, labels pod_name, namespace, node, container_name, gpu."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.domain.specs import EnforcementSpec
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.enforcementnode import EnforcementIntegration
from agent.surfaces.metrics.families import adder, gpu_label

LEGACY_LABELS = ["pod_name", "namespace", "node", "container_name", "gpu"]


class LegacyCollector(Collector):
    def __init__(
        self,
        enforcement: EnforcementIntegration,
        specs: Callable[[], Sequence[EnforcementSpec]],
        gpus: Sequence[GpuInfo],
        node_name: str,
    ) -> None:
        self._enforcement = enforcement
        self._specs = specs
        self._memory_mib = {gpu.index: gpu.memory_mib for gpu in gpus}
        self._node = node_name

    def _labels(self, spec: EnforcementSpec) -> dict[str, str]:
        """{LEGACY_LABELS: values}, one dict shared by the container's samples."""
        return {
            "pod_name": spec.pod,
            "namespace": spec.namespace,
            "node": self._node,
            "container_name": spec.container,
            "gpu": gpu_label(spec.gpus),
        }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util = GaugeMetricFamily(
            "container_gpu_utilization",
            "gpu-manager name: GPU utilization of the container, percent",
            labels=LEGACY_LABELS,
        )
        used = GaugeMetricFamily(
            "container_gpu_memory_total",
            "gpu-manager name: GPU memory the container uses, MiB",
            labels=LEGACY_LABELS,
        )
        add_util, add_used = adder(util), adder(used)
        memory = self._enforcement.memory.usage_by_container()
        for control in self._enforcement.enforcer.controls():
            labels = self._labels(control.spec)
            add_util(labels, control.used)
            used_mib = memory.get(control.spec.label)
            if used_mib is not None:
                add_used(labels, float(used_mib))
        request_util = GaugeMetricFamily(
            "container_request_gpu_utilization",
            "gpu-manager name: GPU requested by the container, percent of one GPU (vcuda-core)",
            labels=LEGACY_LABELS,
        )
        request_memory = GaugeMetricFamily(
            "container_request_gpu_memory",
            "gpu-manager name: GPU memory requested by the container, MiB (whole GPUs: their memory)",
            labels=LEGACY_LABELS,
        )
        add_request_util, add_request_memory = adder(request_util), adder(request_memory)
        for spec in self._specs():
            labels = self._labels(spec)
            add_request_util(labels, float(spec.cores))
            mib = spec.memory_quota_mib
            if mib is None:
                mib = sum(self._memory_mib.get(g, 0) for g in spec.gpus)
            add_request_memory(labels, float(mib))
        yield from (util, used, request_util, request_memory)
