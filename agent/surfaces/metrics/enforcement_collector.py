"""Enforcement metrics at scrape time: measured use, duty, freezes and memory actions per
container; GPU utilization and memory used; the control loop's own cost."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from agent.control.containers import DURATION_BUCKETS_S
from agent.platform.gpu.inventory import GpuInfo
from agent.surfaces.enforcementnode import EnforcementIntegration
from agent.surfaces.metrics.families import CONTAINER_LABELS, adder, container_labels

MIB = 1024 * 1024
GPU_LABELS = ["node", "gpu", "uuid", "model"]
MetricFamily = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


class EnforcementCollector(Collector):
    def __init__(self, enforcement: EnforcementIntegration, gpus: Sequence[GpuInfo], node_name: str) -> None:
        self._enforcement = enforcement
        self._gpus = tuple(gpus)
        self._node = node_name

    def collect(self) -> Iterator[MetricFamily]:
        yield from self._gpu_metrics()
        yield from self._container_metrics()
        yield from self._loop_metrics()

    def _gpu_metrics(self) -> Iterator[MetricFamily]:
        views = self._enforcement.enforcer.gpu_views()
        util = GaugeMetricFamily(
            "vcuda_gpu_utilization_ratio",
            "Whole-GPU SM utilization over the control window",
            labels=GPU_LABELS,
        )
        used = GaugeMetricFamily(
            "vcuda_gpu_memory_used_bytes", "GPU memory held by processes (NVML)", labels=GPU_LABELS
        )
        for gpu in self._gpus:
            labels = [self._node, str(gpu.index), gpu.uuid, gpu.model]
            view = views.get(gpu.index)
            if view is not None and view.device_percent is not None:
                util.add_metric(labels, view.device_percent / 100)
            mib = self._enforcement.memory.gpu_used_mib(gpu.index)
            if mib is not None:
                used.add_metric(labels, float(mib * MIB))
        yield util
        yield used

    def _container_metrics(self) -> Iterator[MetricFamily]:
        memory = self._enforcement.memory.usage_by_container()
        util = GaugeMetricFamily(
            "vcuda_container_gpu_utilization_ratio",
            "The container's measured share of its GPU over the control window (absent: never measured, "
            "e.g. an MPS client whose work NVML credits to the MPS server)",
            labels=CONTAINER_LABELS,
        )
        duty = GaugeMetricFamily(
            "vcuda_container_throttle_duty_ratio",
            "Share of the time the container is thawed (1: not throttled)",
            labels=CONTAINER_LABELS,
        )
        cycle = GaugeMetricFamily(
            "vcuda_container_throttle_cycle_seconds",
            "While the container is throttled: the mean time between its turns (turns), or its GPU's duty "
            "cycle (duty cycles); absent: not throttled",
            labels=CONTAINER_LABELS,
        )
        unholdable = GaugeMetricFamily(
            "vcuda_container_share_unholdable",
            "1 while the container is held but its cap cannot be held by freezing (work runs on "
            "too long after each freeze; status says why), else 0",
            labels=CONTAINER_LABELS,
        )
        target = GaugeMetricFamily(
            "vcuda_container_target_ratio",
            "The utilization the controller holds the container to now (absent: not throttled)",
            labels=CONTAINER_LABELS,
        )
        frozen = CounterMetricFamily(
            "vcuda_container_frozen_seconds",
            "Time the container spent frozen by the agent",
            labels=CONTAINER_LABELS,
        )
        actions = CounterMetricFamily(
            "vcuda_container_throttle_actions",
            "Freezes of the container (duty-cycle slices)",
            labels=CONTAINER_LABELS,
        )
        mem = GaugeMetricFamily(
            "vcuda_container_gpu_memory_used_bytes",
            "GPU memory the container's processes hold (max of NVML and the ioctl tracer)",
            labels=CONTAINER_LABELS,
        )
        add_util, add_duty, add_target = adder(util), adder(duty), adder(target)
        add_cycle, add_unholdable = adder(cycle), adder(unholdable)
        add_frozen, add_actions, add_mem = adder(frozen), adder(actions), adder(mem)
        node = self._node
        enforcer = self._enforcement.enforcer
        for control in enforcer.controls():
            spec = control.spec
            labels = container_labels(node, spec)  # one dict, shared by the container's samples
            if enforcer.measured(control):
                add_util(labels, control.used / 100)
            add_duty(labels, control.state.duty)
            if control.goal is not None:
                add_target(labels, control.goal / 100)
            if control.throttled:
                add_cycle(labels, control.cycle_s)
            add_unholdable(labels, 1.0 if control.throttled and control.unholdable else 0.0)
            add_frozen(labels, control.frozen_s)
            add_actions(labels, float(control.freezes))
            used_mib = memory.get(spec.label)
            if used_mib is not None:
                add_mem(labels, float(used_mib * MIB))
        yield from (util, duty, cycle, unholdable, target, frozen, actions, mem)
        quota = CounterMetricFamily(
            "vcuda_memory_quota_actions",
            "What the memory guard did about containers over their vcuda-memory",
            labels=["node", "mode", "action"],
        )
        mode = self._enforcement.memory.mode
        for action, count in self._enforcement.memory.guard.stats().items():
            quota.add_metric([self._node, mode, action], float(count))
        yield quota

    def _loop_metrics(self) -> Iterator[MetricFamily]:
        stats = self._enforcement.enforcer.stats
        buckets = [
            (str(bound), float(count))
            for bound, count in zip(DURATION_BUCKETS_S, stats.bucket_counts, strict=True)
        ]
        buckets.append(("+Inf", float(stats.periods)))
        loop = HistogramMetricFamily(
            "vcuda_control_loop_duration_seconds",
            "Work time of one control period (measure, decide, act), sleeps excluded",
            labels=["node"],
        )
        loop.add_metric([self._node], buckets, stats.duration_sum_s)
        yield loop
        for name, help_text, value in (
            ("vcuda_control_overruns", "Control periods that started a period or more late", stats.overruns),
            (
                "vcuda_control_measure_errors",
                "Failed reads of GPU utilization (NVML errors)",
                stats.measure_errors,
            ),
            ("vcuda_control_actuator_errors", "Failed freezes, thaws or releases", stats.actuator_errors),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["node"])
            counter.add_metric([self._node], float(value))
            yield counter
        nvml = CounterMetricFamily(
            "vcuda_nvml_errors",
            "Failed GPU backend reads (NVML, or the simulator): utilization by the control loop "
            "plus per-process memory by the memory guard",
            labels=["node"],
        )
        nvml.add_metric([self._node], float(stats.measure_errors + self._enforcement.memory.read_errors))
        yield nvml
        watchdog = GaugeMetricFamily(
            "vcuda_watchdog_running",
            "1 while the watchdog process that thaws on agent death runs",
            labels=["node"],
        )
        watchdog.add_metric([self._node], 1.0 if self._enforcement.watchdog_state() == "running" else 0.0)
        yield watchdog
        journal = GaugeMetricFamily(
            "vcuda_freeze_journal_writable",
            "0 since a write of the freeze journal failed (e.g. disk full: containers it does not "
            "list yet are not frozen), 1 otherwise",
            labels=["node"],
        )
        journal.add_metric([self._node], 0.0 if self._enforcement.journal.write_error else 1.0)
        yield journal
