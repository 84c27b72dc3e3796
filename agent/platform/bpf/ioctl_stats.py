"""What the ioctl tracer reports, decoded from its BPF maps into plain values.

The tracer reads raw rows (numbers, no bcc types) and :func:`build_snapshot` turns them
into per-(cgroup, pid) statistics, so the decoding is testable without BPF.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

LATENCY_SLOTS = 32  # must match LATENCY_SLOTS in bpf/ioctl_tracer.c

# Order of the u64 counters of `struct proc_objects` in bpf/ioctl_tracer.c.
OBJECT_FIELDS = (
    "vidmem_allocs",
    "vidmem_frees",
    "vidmem_bytes_allocated",
    "vidmem_bytes_freed",
    "channels_created",
    "channels_freed",
)
# Order of `enum drop_kind` in bpf/ioctl_tracer.c.
DROP_FIELDS = ("inflight", "escapes", "procs", "objects")
NO_LATENCY = (0,) * LATENCY_SLOTS


def latency_bucket_bounds_ns(slot: int) -> tuple[int, int | None]:
    """[low, high) in ns of histogram slot ``slot``; slot 0 includes 0, the last one has no upper bound."""
    if not 0 <= slot < LATENCY_SLOTS:
        raise ValueError(f"latency slot {slot} is outside 0..{LATENCY_SLOTS - 1}")
    low = 0 if slot == 0 else 1 << slot
    return low, None if slot == LATENCY_SLOTS - 1 else 1 << (slot + 1)


class ProcessKey(NamedTuple):
    """A process as the tracer sees it: the cgroup (v2 id, the inode of its directory) and the tgid."""

    cgroup_id: int
    pid: int


@dataclass(frozen=True)
class EscapeRow:
    """One entry of the `escape_stats` map: one escape code of one process."""

    cgroup_id: int
    pid: int
    escape: int
    calls: int
    errors: int
    latency: Sequence[int]  # LATENCY_SLOTS counts


@dataclass(frozen=True)
class ObjectRow:
    """One entry of the `proc_objects` map."""

    cgroup_id: int
    pid: int
    counters: Sequence[int]  # in OBJECT_FIELDS order


@dataclass(frozen=True)
class ProcessIoctlStats:
    """NVIDIA ioctl activity of one process in one cgroup since the tracer started (or the process did)."""

    cgroup_id: int
    pid: int
    calls: int
    errors: int
    calls_by_escape: Mapping[int, int]
    latency_log2_ns: tuple[int, ...]  # see latency_bucket_bounds_ns
    vidmem_allocs: int
    vidmem_frees: int
    vidmem_bytes_allocated: int
    vidmem_bytes_freed: int
    channels_created: int
    channels_freed: int

    @property
    def key(self) -> ProcessKey:
        return ProcessKey(self.cgroup_id, self.pid)

    @property
    def vidmem_bytes(self) -> int:
        """Video memory the process holds now, as far as the allocations and frees seen tell."""
        return self.vidmem_bytes_allocated - self.vidmem_bytes_freed

    @property
    def vidmem_objects(self) -> int:
        return self.vidmem_allocs - self.vidmem_frees

    @property
    def channels(self) -> int:
        """GPFIFO channels (GPU contexts and streams) open now."""
        return self.channels_created - self.channels_freed


@dataclass(frozen=True)
class DropCounts:
    """Events lost because a BPF map was full (the maps are bounded; see bpf/ioctl_tracer.c)."""

    inflight: int = 0  # calls not counted: no per-thread state
    escapes: int = 0  # calls not counted: no room for a new (cgroup, pid, escape)
    procs: int = 0  # allocations or frees not counted: no room for a new (cgroup, pid)
    objects: int = 0  # allocations counted but not remembered: their frees are not subtracted

    @property
    def total(self) -> int:
        return self.inflight + self.procs + self.escapes + self.objects


@dataclass(frozen=True)
class IoctlSnapshot:
    """Everything the tracer has counted, at one moment."""

    processes: Mapping[ProcessKey, ProcessIoctlStats] = field(default_factory=dict)
    drops: DropCounts = field(default_factory=DropCounts)

    def for_cgroup(self, cgroup_id: int) -> list[ProcessIoctlStats]:
        return [s for key, s in self.processes.items() if key.cgroup_id == cgroup_id]

    def for_pid(self, pid: int) -> list[ProcessIoctlStats]:
        """Usually one entry; more when the process moved between cgroups while tracing."""
        return [s for key, s in self.processes.items() if key.pid == pid]


def build_snapshot(
    escape_rows: Iterable[EscapeRow], object_rows: Iterable[ObjectRow], drops: Sequence[int]
) -> IoctlSnapshot:
    """Join the maps' rows per (cgroup, pid): calls and latencies summed over escapes."""
    calls: dict[ProcessKey, dict[int, int]] = {}
    errors: dict[ProcessKey, int] = {}
    latencies: dict[ProcessKey, list[Sequence[int]]] = {}
    for row in escape_rows:
        if len(row.latency) != LATENCY_SLOTS:
            raise ValueError(
                f"escape_stats row for {row.cgroup_id}/{row.pid} has {len(row.latency)} latency slots, "
                f"expected {LATENCY_SLOTS}"
            )
        key = ProcessKey(row.cgroup_id, row.pid)
        calls.setdefault(key, {})[row.escape] = row.calls
        errors[key] = errors.get(key, 0) + row.errors
        latencies.setdefault(key, []).append(row.latency)
    objects: dict[ProcessKey, list[int]] = {}
    for obj in object_rows:
        if len(obj.counters) != len(OBJECT_FIELDS):
            raise ValueError(
                f"proc_objects row for {obj.cgroup_id}/{obj.pid} has {len(obj.counters)} counters, "
                f"expected {len(OBJECT_FIELDS)}"
            )
        objects[ProcessKey(obj.cgroup_id, obj.pid)] = list(obj.counters)
    processes: dict[ProcessKey, ProcessIoctlStats] = {}
    for key in calls.keys() | objects.keys():
        allocs, frees, allocated, freed, created, closed = objects.get(key, [0] * len(OBJECT_FIELDS))
        by_escape = calls.get(key, {})
        processes[key] = ProcessIoctlStats(
            cgroup_id=key.cgroup_id,
            pid=key.pid,
            calls=sum(by_escape.values()),
            errors=errors.get(key, 0),
            calls_by_escape=dict(sorted(by_escape.items())),
            latency_log2_ns=tuple(map(sum, zip(*latencies[key], strict=True)))
            if key in latencies
            else NO_LATENCY,
            vidmem_allocs=allocs,
            vidmem_frees=frees,
            vidmem_bytes_allocated=allocated,
            vidmem_bytes_freed=freed,
            channels_created=created,
            channels_freed=closed,
        )
    if len(drops) != len(DROP_FIELDS):
        raise ValueError(f"drops has {len(drops)} counters, expected {len(DROP_FIELDS)}")
    return IoctlSnapshot(processes, DropCounts(*(int(n) for n in drops)))
