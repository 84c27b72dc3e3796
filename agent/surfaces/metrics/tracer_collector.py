"""Per-container NVIDIA ioctl activity from the eBPF tracer: calls by escape and video memory
allocated. The tracer counts per (cgroup id, pid); cgroup ids map to containers through the
cgroup resolver's index (cached: walking the tree on every scrape would not stay cheap) and
containers to names through the enforcement specs. No tracer, no samples."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agent.clock import Clock, SystemClock
from agent.domain.specs import EnforcementSpec
from agent.errors import VcudaError
from agent.platform.bpf.ioctl_stats import IoctlSnapshot
from agent.platform.bpf.nvioctl import escape_name
from agent.platform.cgroups.paths import ContainerRef
from agent.surfaces.metrics.families import adder

log = logging.getLogger(__name__)

INDEX_TTL_S = 5.0
LABELS = ("node", "namespace", "pod", "container")
CALL_LABELS = (*LABELS, "escape")


class SnapshotSource(Protocol):
    def snapshot(self) -> IoctlSnapshot: ...


class CgroupIndex:
    """{cgroup id: container}, rebuilt at most every ``ttl_s`` and on a miss no sooner."""

    def __init__(self, build: Callable[[], dict[int, ContainerRef]], clock: Clock, ttl_s: float) -> None:
        self._build = build
        self._clock = clock
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._index: dict[int, ContainerRef] = {}
        self._built_at: float | None = None

    def get(self) -> dict[int, ContainerRef]:
        with self._lock:
            now = self._clock.monotonic()
            if self._built_at is None or now - self._built_at >= self._ttl_s:
                try:
                    self._index = self._build()
                except (VcudaError, OSError) as err:  # keep the last index: a scrape must not fail
                    log.debug("cgroup index: %s", err)
                self._built_at = now
            return self._index


class TracerCollector(Collector):
    def __init__(
        self,
        tracer: Callable[[], SnapshotSource | None],
        cgroup_index: Callable[[], dict[int, ContainerRef]],
        specs: Callable[[], Sequence[EnforcementSpec]],
        node_name: str,
        *,
        clock: Clock | None = None,
        index_ttl_s: float = INDEX_TTL_S,
    ) -> None:
        self._tracer = tracer  # a callable: the tracer starts (or not) after the collector is built
        self._index = CgroupIndex(cgroup_index, clock or SystemClock(), index_ttl_s)
        self._specs = specs
        self._node = node_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        tracer = self._tracer()
        if tracer is None:
            return
        try:
            snapshot = tracer.snapshot()
        except VcudaError as err:
            log.debug("ioctl tracer snapshot: %s", err)
            return
        # Plain (pod UID, container ID) keys: ContainerRef's generated hash is a Python call.
        names = {(s.pod_uid, s.container_id): s for s in self._specs() if s.container_id}
        index = self._index.get()
        calls: dict[tuple[str, ...], int] = {}
        allocated: dict[tuple[str, ...], int] = {}
        for stats in snapshot.processes.values():
            ref = index.get(stats.cgroup_id)
            spec = names.get((ref.pod_uid, ref.container_id)) if ref is not None else None
            if spec is None:
                continue  # not a container the agent knows: no names to label it with
            labels = (self._node, spec.namespace, spec.pod, spec.container)
            for escape, count in stats.calls_by_escape.items():
                key = (*labels, escape_name(escape))
                calls[key] = calls.get(key, 0) + count
            allocated[labels] = allocated.get(labels, 0) + stats.vidmem_bytes_allocated
        ioctls = CounterMetricFamily(
            "vcuda_container_ioctl_calls",
            "NVIDIA ioctls by escape of the container's live processes, from the eBPF tracer "
            "(drops when a process exits: read as a counter reset)",
            labels=CALL_LABELS,
        )
        add_calls = adder(ioctls)
        for call_key, count in sorted(calls.items()):
            add_calls(dict(zip(CALL_LABELS, call_key, strict=True)), float(count))
        memory = CounterMetricFamily(
            "vcuda_container_gpu_memory_allocated_bytes",
            "Video memory the container's live processes allocated (RM_ALLOC), frees not subtracted, "
            "from the eBPF tracer",
            labels=LABELS,
        )
        add_allocated = adder(memory)
        for container, total in sorted(allocated.items()):
            add_allocated(dict(zip(LABELS, container, strict=True)), float(total))
        yield ioctls
        yield memory
