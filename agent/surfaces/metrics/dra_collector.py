"""The DRA driver's state (``run --dra``): kubelet registration, prepared claims, the
ResourceSlice as last written, publication errors."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.surfaces.dranode import DraIntegration


class DraCollector(Collector):
    def __init__(self, dra: DraIntegration, node_name: str) -> None:
        self._dra = dra
        self._node = node_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        endpoint = self._dra.plugin.status()
        stats = self._dra.publisher.stats
        labels = [self._node]
        registered = GaugeMetricFamily(
            "vcuda_dra_plugin_registered",
            "1 while kubelet has the DRA plugin gpu.vcuda.io registered",
            labels=["node"],
        )
        registered.add_metric(labels, 1.0 if endpoint.registered else 0.0)
        prepared = GaugeMetricFamily(
            "vcuda_dra_prepared_claims", "ResourceClaims prepared on this node", labels=["node"]
        )
        prepared.add_metric(labels, float(len(self._dra.plugin.prepared.prepared())))
        devices = GaugeMetricFamily(
            "vcuda_dra_slice_devices",
            "Devices (healthy DRA GPUs) in the node's ResourceSlice",
            labels=["node"],
        )
        devices.add_metric(labels, float(stats.devices))
        generation = GaugeMetricFamily(
            "vcuda_dra_slice_generation", "spec.pool.generation of the node's ResourceSlice", labels=["node"]
        )
        generation.add_metric(labels, float(stats.generation))
        errors = CounterMetricFamily(
            "vcuda_dra_slice_errors", "ResourceSlice publication passes that failed", labels=["node"]
        )
        errors.add_metric(labels, float(stats.errors))
        yield from (registered, prepared, devices, generation, errors)
