"""The GPUs' MIG side at scrape time: whether each GPU can do MIG, its mode (current and
pending), and its MIG devices with their health and memory (docs/metrics.md, "MIG")."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.domain.health import HealthBoard
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migstate import MigInfo

_MIB = 1024 * 1024
GPU_LABELS = ["node", "gpu", "uuid", "model"]
DEVICE_LABELS = ["node", "gpu", "gi", "ci", "profile", "uuid"]


class MigCollector(Collector):
    def __init__(
        self,
        snapshot: Callable[[], tuple[int, Mapping[int, MigInfo]]],
        board: HealthBoard,
        gpus: Sequence[GpuInfo],
        node_name: str,
    ) -> None:
        self._snapshot = snapshot
        self._board = board
        self._gpus = tuple(gpus)
        self._node = node_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        _, infos = self._snapshot()
        health = self._board.snapshot()[1]
        unhealthy = self._board.unhealthy_instances()
        node = self._node
        capable = GaugeMetricFamily(
            "vcuda_gpu_mig_capable", "1 when the GPU can be partitioned with MIG", labels=GPU_LABELS
        )
        mode = GaugeMetricFamily(
            "vcuda_gpu_mig_mode",
            "1 when the GPU's MIG mode is enabled: state=current, or state=pending (what a reset applies)",
            labels=[*GPU_LABELS, "state"],
        )
        devices = GaugeMetricFamily(
            "vcuda_mig_devices", "MIG devices of the profile on the GPU", labels=["node", "gpu", "profile"]
        )
        healthy = GaugeMetricFamily(
            "vcuda_mig_device_healthy",
            "1 when the MIG device is Healthy (0: an XID on its GPU instance, or on its GPU)",
            labels=DEVICE_LABELS,
        )
        memory = GaugeMetricFamily(
            "vcuda_mig_device_memory_total_bytes",
            "Memory of the MIG device's GPU instance",
            labels=DEVICE_LABELS,
        )
        for gpu in self._gpus:
            info = infos.get(gpu.index, MigInfo(capable=False))
            values = [node, str(gpu.index), gpu.uuid, gpu.model]
            capable.add_metric(values, 1.0 if info.capable else 0.0)
            if not info.capable:
                continue
            mode.add_metric([*values, "current"], 1.0 if info.current else 0.0)
            mode.add_metric([*values, "pending"], 1.0 if info.pending else 0.0)
            counts: dict[str, int] = {}
            gpu_ok = health[gpu.index].healthy if gpu.index in health else True
            for d in info.devices:
                counts[d.profile] = counts.get(d.profile, 0) + 1
                labels = [node, str(gpu.index), str(d.gi), str(d.ci), d.profile, d.uuid]
                ok = gpu_ok and (gpu.index, d.gi) not in unhealthy
                healthy.add_metric(labels, 1.0 if ok else 0.0)
                memory.add_metric(labels, float(d.memory_mib * _MIB))
            for profile, count in sorted(counts.items()):
                devices.add_metric([node, str(gpu.index), profile], float(count))
        yield capable
        yield mode
        yield devices
        yield healthy
        yield memory
