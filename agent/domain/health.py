"""GPU health: which events make a GPU Unhealthy, and the board that tracks it.

Policy follows NVIDIA's device plugin: any critical XID makes the GPU Unhealthy
except those caused by applications (13 graphics engine exception, 31 GPU memory
page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor
exception, 109 context switch timeout). Unhealthy is sticky until the GPU is
reset, as with NVIDIA's plugin: an XID says the hardware needs attention.

An XID the driver attributes to a MIG GPU instance makes that instance Unhealthy, not the
GPU (MIG contains faults to the instance); a GPU reset (recovery) clears its instances'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.platform.gpu.inventory import DeviceEvent, EventKind

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

_XID_NAMES = {
    48: "double-bit ECC error",
    63: "ECC page retirement / row remapping",
    64: "ECC page retirement / row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


@dataclass(frozen=True)
class HealthPolicy:
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS

    def verdict(self, event: DeviceEvent) -> tuple[bool, str] | None:
        """``(healthy, reason)`` for an event that changes health, ``None`` for one that does not."""
        if event.kind is EventKind.LOST:
            return False, f"GPU lost: {event.detail or 'fell off the bus'}"
        if event.kind is EventKind.RECOVERED:
            return True, event.detail or "GPU recovered"
        if event.xid is None or event.xid in self.ignored_xids:
            return None
        name = _XID_NAMES.get(event.xid, "critical XID")
        return False, f"XID {event.xid} ({name})"


@dataclass(frozen=True)
class GpuHealth:
    healthy: bool
    reason: str
    since: float  # wall time of the last change


class XidCounts:
    """Thread-safe count of XID events per (GPU, XID), ignored ones included: metrics read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int], int] = {}

    def record(self, gpu_index: int, xid: int) -> None:
        with self._lock:
            key = (gpu_index, xid)
            self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[int, int], int]:
        """{(GPU index, XID): events since the agent started}."""
        with self._lock:
            return dict(self._counts)


class HealthBoard:
    """Thread-safe health of every GPU with a version that grows on each change."""

    def __init__(self, indexes: Iterable[int]) -> None:
        now = time.time()
        self._state = {i: GpuHealth(True, "", now) for i in indexes}
        self._instances: dict[tuple[int, int], GpuHealth] = {}  # (GPU, GI id) -> health
        self.xids = XidCounts()  # here so that the health loop and the metrics share one
        self._version = 0
        self._changed = threading.Condition()

    def snapshot(self) -> tuple[int, Mapping[int, GpuHealth]]:
        with self._changed:
            return self._version, dict(self._state)

    def is_healthy(self, index: int) -> bool:
        with self._changed:
            return self._state[index].healthy

    def set(self, index: int, healthy: bool, reason: str) -> bool:
        """Record a health state; True when it changed (listeners are woken)."""
        with self._changed:
            current = self._state.get(index)
            if current is None or current.healthy == healthy:
                return False
            self._state[index] = GpuHealth(healthy, reason, time.time())
            self._version += 1
            self._changed.notify_all()
            return True

    def set_instance(self, index: int, gi: int, healthy: bool, reason: str) -> bool:
        """Record the health of MIG GPU instance ``gi`` of GPU ``index``; True when it changed."""
        with self._changed:
            if index not in self._state:
                return False
            current = self._instances.get((index, gi))
            if (current.healthy if current is not None else True) == healthy:
                return False
            if healthy:
                del self._instances[(index, gi)]
            else:
                self._instances[(index, gi)] = GpuHealth(False, reason, time.time())
            self._version += 1
            self._changed.notify_all()
            return True

    def unhealthy_instances(self) -> dict[tuple[int, int], GpuHealth]:
        """{(GPU index, GI id): health} of the MIG GPU instances that are Unhealthy."""
        with self._changed:
            return dict(self._instances)

    def clear_instances(self, index: int, keep: Iterable[int] | None = None) -> None:
        """Forget GPU ``index``'s unhealthy instances (all, or those not in ``keep``: the GPU
        was reset, or the instances are gone)."""
        kept = None if keep is None else set(keep)
        with self._changed:
            gone = [k for k in self._instances if k[0] == index and (kept is None or k[1] not in kept)]
            for key in gone:
                del self._instances[key]
            if gone:
                self._version += 1
                self._changed.notify_all()

    def wait_for_change(
        self, seen_version: int, timeout_s: float, abort: threading.Event | None = None
    ) -> int:
        """Block until the version passes ``seen_version``, ``abort`` is set (then ``wake_all``
        is called) or the timeout; return the current version."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._version != seen_version or (abort is not None and abort.is_set()),
                timeout=timeout_s,
            )
            return self._version

    def touch(self) -> None:
        """A new version without a health change: what the GPUs offer changed (a GPU went into
        MIG mode), so every listener of the board (the device plugin, the node publisher)
        looks again."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def wake_all(self) -> None:
        """Wake waiters so they re-check their ``abort`` event."""
        with self._changed:
            self._changed.notify_all()
