"""XID events per GPU, counted by the health loop (ignored XIDs included)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agent.domain.health import XidCounts
from agent.platform.gpu.inventory import GpuInfo


class XidCollector(Collector):
    def __init__(self, xids: XidCounts, gpus: Sequence[GpuInfo], node_name: str) -> None:
        self._xids = xids
        self._gpus = {gpu.index: gpu for gpu in gpus}
        self._node = node_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "vcuda_gpu_xid_errors",
            "XID events the driver reported for the GPU since the agent started (ignored XIDs included)",
            labels=["node", "gpu", "uuid", "model", "xid"],
        )
        for (index, xid), count in sorted(self._xids.snapshot().items()):
            gpu = self._gpus.get(index)
            uuid, model = (gpu.uuid, gpu.model) if gpu is not None else ("", "")
            family.add_metric([self._node, str(index), uuid, model, str(xid)], float(count))
        yield family
