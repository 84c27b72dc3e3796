"""Hardware-isolated shares at scrape time: the MIG instances made for pods on the GPUs of
``mig.onDemand`` (docs/metrics.md, "MIG")."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.control.migsharebook import IsolatedShare


class MigShareCollector(Collector):
    def __init__(
        self,
        shares: Callable[[], Sequence[IsolatedShare]],
        node_name: str,
    ) -> None:
        self._shares = shares
        self._node = node_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = GaugeMetricFamily(
            "vcuda_mig_isolated_shares",
            "Hardware-isolated shares served by a MIG instance of the profile made for them on the GPU",
            labels=["node", "gpu", "profile"],
        )
        by: dict[tuple[int, str], int] = {}
        for share in self._shares():
            by[(share.gpu, share.profile)] = by.get((share.gpu, share.profile), 0) + 1
        for (gpu, profile), count in sorted(by.items()):
            counts.add_metric([self._node, str(gpu), profile], float(count))
        yield counts
