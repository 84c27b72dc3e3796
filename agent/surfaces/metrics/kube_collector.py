"""Allocation metrics, built at scrape time from the ledger and the enforcement specs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.control.allocations import Allocations
from agent.control.recovery import LedgerRecovery
from agent.domain.ledger import Ledger
from agent.domain.specs import EnforcementSpec
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.metrics.families import CONTAINER_LABELS, adder, container_labels

_MIB = 1024 * 1024
_GPU = ["node", "gpu", "uuid", "model"]


class KubeView(Protocol):
    node_name: str
    ledger: Ledger
    allocations: Allocations
    recovery: LedgerRecovery

    def specs(self) -> list[EnforcementSpec]: ...


class AllocationCollector(Collector):
    def __init__(self, view: KubeView, gpus: Sequence[GpuInfo]) -> None:
        self._view = view
        self._gpus = tuple(gpus)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        view, node = self._view, self._view.node_name
        cores = GaugeMetricFamily(
            "vcuda_gpu_cores_allocated", "vcuda-core units assigned (100 per GPU)", labels=_GPU
        )
        memory = GaugeMetricFamily(
            "vcuda_gpu_memory_allocated_bytes", "vcuda-memory assigned on the GPU", labels=_GPU
        )
        capacity = GaugeMetricFamily(
            "vcuda_gpu_memory_schedulable_bytes", "GPU memory x deviceMemoryScaling", labels=_GPU
        )
        for gpu in self._gpus:
            usage = view.ledger.usage(gpu.index)
            labels = [node, str(gpu.index), gpu.uuid, gpu.model]
            cores.add_metric(labels, float(usage.cores))
            memory.add_metric(labels, float(usage.memory_mib * _MIB))
            capacity.add_metric(labels, float(usage.memory_capacity_mib * _MIB))
        yield from (cores, memory, capacity)
        yield from self._containers(view.specs(), node)
        allocations = CounterMetricFamily(
            "vcuda_allocations", "Allocate calls matched to a pod, by result", labels=["node", "result"]
        )
        allocations.add_metric([node, "assigned"], float(view.allocations.allocations))
        allocations.add_metric([node, "refused"], float(view.allocations.refusals))
        yield allocations
        corrections = CounterMetricFamily(
            "vcuda_ledger_corrections",
            "Ledger entries corrected after kubelet's pod-resources named another pod",
            labels=["node"],
        )
        corrections.add_metric([node], float(view.recovery.corrections))
        yield corrections

    @staticmethod
    def _containers(specs: list[EnforcementSpec], node: str) -> Iterator[GaugeMetricFamily]:
        request = GaugeMetricFamily(
            "vcuda_container_request_cores", "vcuda-core requested by the container", labels=CONTAINER_LABELS
        )
        cap = GaugeMetricFamily(
            "vcuda_container_cap_ratio",
            "Utilization cap as a fraction of one GPU (absent for whole GPUs)",
            labels=CONTAINER_LABELS,
        )
        quota = GaugeMetricFamily(
            "vcuda_container_memory_quota_bytes",
            "GPU memory quota (absent for whole GPUs)",
            labels=CONTAINER_LABELS,
        )
        policy = GaugeMetricFamily(
            "vcuda_container_policy_info",
            "The container's isolation policy",
            labels=[*CONTAINER_LABELS, "policy"],
        )
        add_request, add_cap, add_quota, add_policy = adder(request), adder(cap), adder(quota), adder(policy)
        for spec in specs:
            labels = container_labels(node, spec)  # one dict, shared by the container's samples
            add_request(labels, float(spec.cores))
            if spec.cap is not None:
                add_cap(labels, spec.cap / 100)
            if spec.memory_quota_mib is not None:
                add_quota(labels, float(spec.memory_quota_mib * _MIB))
            add_policy({**labels, "policy": spec.policy.value}, 1.0)
        yield from (request, cap, quota, policy)
