"""The allocation ledger: per GPU, which pod/container holds how many cores and MiB.

A share (< 100 cores) holds its cores and its vcuda-memory request on one GPU; a
whole-GPU container holds all of each of its GPUs. Init containers run one at a time
and before the app containers, so a pod's init containers never count against its
own app containers or each other: per GPU a pod holds max(Σ app, max init).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agent.domain.ids import UNITS_PER_GPU
from agent.errors import InsufficientCapacityError
from agent.platform.gpu.inventory import GpuInfo


@dataclass(frozen=True)
class Assignment:
    pod_uid: str
    namespace: str
    pod: str
    container: str
    init: bool
    gpus: tuple[int, ...]  # one GPU for a share; N GPUs for N x 100 cores
    cores: int  # total vcuda-core of the container
    memory_mib: int  # the memory quota on its GPU (a share); 0 for whole GPUs (they hold all of it)
    device_ids: frozenset[str] = field(default_factory=frozenset)  # empty when rebuilt from annotations
    # A DRA claim's ShareConfig (control/draledger.py); None: from the pod's annotations.
    policy: str | None = None
    limit: int | None = None
    source: str = "device-plugin"  # or "dra"
    # (cores, MiB) the entry counts against its GPU when that is less than its caps: the
    # containers of one DRA claim split what the claim consumed, yet each is capped at no less
    # than 1 core (and 1 MiB when the claim has memory), so none runs unenforced.
    charge: tuple[int, int] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.pod_uid, self.container

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    @property
    def whole(self) -> bool:
        return self.cores >= UNITS_PER_GPU


@dataclass(frozen=True)
class GpuUsage:
    index: int
    cores: int
    memory_mib: int
    cores_capacity: int
    memory_capacity_mib: int
    holders: tuple[Assignment, ...]


class Ledger:
    """Thread-safe; ``scaling`` is read at each check so a node-config reload applies at once."""

    def __init__(self, gpus: Sequence[GpuInfo], scaling: Callable[[], float] = lambda: 1.0) -> None:
        self._gpus = {g.index: g for g in gpus}
        self._scaling = scaling
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], Assignment] = {}
        self._on_gpu: dict[int, dict[tuple[str, str], Assignment]] = {g.index: {} for g in gpus}
        self._by_device: dict[str, Assignment] = {}
        self.version = 0  # bumped on every change, for readers that cache derived views
        self._keys: frozenset[tuple[str, str]] = frozenset()
        self._keys_version = 0

    def memory_capacity_mib(self, index: int) -> int:
        return int(self._gpus[index].memory_mib * self._scaling())

    # Reading ---------------------------------------------------------------
    def assignments(self) -> list[Assignment]:
        with self._lock:
            return list(self._held.values())

    def keys(self) -> frozenset[tuple[str, str]]:
        """(pod uid, container) of every entry, as one snapshot."""
        with self._lock:
            if self._keys_version != self.version:
                self._keys, self._keys_version = frozenset(self._held), self.version
            return self._keys

    def get(self, pod_uid: str, container: str) -> Assignment | None:
        with self._lock:
            return self._held.get((pod_uid, container))

    def of_pod(self, pod_uid: str) -> list[Assignment]:
        with self._lock:
            return [a for a in self._held.values() if a.pod_uid == pod_uid]

    def holder_of(self, device_id: str) -> Assignment | None:
        with self._lock:
            return self._by_device.get(device_id)

    def usage(self, index: int) -> GpuUsage:
        with self._lock:
            return self._usage(index, exclude_pod=None)

    def free(self, index: int, for_pod: str | None = None, init: bool = False) -> tuple[int, int]:
        """(cores, MiB) still free on a GPU for a new container of ``for_pod``."""
        with self._lock:
            used = self._usage(index, exclude_pod=for_pod if init else None, skip_init_of=for_pod)
        return used.cores_capacity - used.cores, used.memory_capacity_mib - used.memory_mib

    # Writing ---------------------------------------------------------------
    def assign(self, item: Assignment) -> None:
        """Record ``item``; raise InsufficientCapacityError (ledger unchanged) if a GPU would
        be oversubscribed. Re-assigning the same pod/container replaces its old entry."""
        with self._lock:
            old = self._held.get(item.key)
            if old is not None:
                self._remove(old)
            try:
                self._check(item)
            except InsufficientCapacityError:
                if old is not None:
                    self._add(old)
                raise
            self._add(item)
            self.version += 1

    def release(self, pod_uid: str, container: str | None = None) -> list[Assignment]:
        """Drop a pod's assignments (or one container's); returns what was dropped."""
        with self._lock:
            dropped = [
                a for a in self._held.values() if a.pod_uid == pod_uid and container in (None, a.container)
            ]
            for item in dropped:
                self._remove(item)
            if dropped:
                self.version += 1
            return dropped

    def replace_all(self, items: Iterable[Assignment]) -> list[str]:
        """Start over from ``items`` (recovery); entries that do not fit are skipped and
        reported, so one bad record cannot block the rest."""
        problems: list[str] = []
        with self._lock:
            for item in list(self._held.values()):
                self._remove(item)
            for item in items:
                try:
                    self._check(item)
                except InsufficientCapacityError as err:
                    problems.append(f"{item.label}: {err}")
                    continue
                self._add(item)
            self.version += 1
        return problems

    # Internals (lock held) ---------------------------------------------------
    def _add(self, item: Assignment) -> None:
        self._held[item.key] = item
        for index in item.gpus:
            self._on_gpu.setdefault(index, {})[item.key] = item
        self._by_device.update(dict.fromkeys(item.device_ids, item))

    def _remove(self, item: Assignment) -> None:
        del self._held[item.key]
        for index in item.gpus:
            self._on_gpu.get(index, {}).pop(item.key, None)
        for device_id in item.device_ids:
            if self._by_device.get(device_id) is item:
                del self._by_device[device_id]

    def _usage(self, index: int, exclude_pod: str | None, skip_init_of: str | None = None) -> GpuUsage:
        capacity = self.memory_capacity_mib(index)
        holders = tuple(a for a in self._on_gpu.get(index, {}).values() if a.pod_uid != exclude_pod)
        per_pod: dict[str, tuple[list[Assignment], list[Assignment]]] = {}
        for a in holders:
            if a.init and a.pod_uid == skip_init_of:
                continue
            apps, inits = per_pod.setdefault(a.pod_uid, ([], []))
            (inits if a.init else apps).append(a)
        cores = memory = 0
        for apps, inits in per_pod.values():
            app_cores, app_mem = sum(_cores_on(a) for a in apps), sum(_mem_on(a, capacity) for a in apps)
            init_cores = max((_cores_on(a) for a in inits), default=0)
            init_mem = max((_mem_on(a, capacity) for a in inits), default=0)
            cores += max(app_cores, init_cores)
            memory += max(app_mem, init_mem)
        return GpuUsage(index, cores, memory, UNITS_PER_GPU, capacity, holders)

    def _check(self, item: Assignment) -> None:
        for index in item.gpus:
            if index not in self._gpus:
                raise InsufficientCapacityError(f"{item.label}: GPU {index} is not on this node")
            # A new init container runs alone in its pod; a new app container runs with its
            # pod's other app containers but after its init containers.
            used = self._usage(
                index,
                exclude_pod=item.pod_uid if item.init else None,
                skip_init_of=item.pod_uid,
            )
            free_cores = used.cores_capacity - used.cores
            free_mem = used.memory_capacity_mib - used.memory_mib
            need_cores, need_mem = _cores_on(item), _mem_on(item, used.memory_capacity_mib)
            if need_cores > free_cores or need_mem > free_mem:
                raise InsufficientCapacityError(
                    f"{item.label} needs {need_cores} vcuda-core and {need_mem} MiB on GPU {index}, "
                    f"which has {free_cores} cores and {free_mem} MiB of vcuda-memory free "
                    f"(held by {_holders(used.holders)})"
                )


def _cores_on(item: Assignment) -> int:
    if item.whole:
        return UNITS_PER_GPU
    return item.cores if item.charge is None else item.charge[0]


def _mem_on(item: Assignment, capacity_mib: int) -> int:
    if item.whole:
        return capacity_mib  # a whole GPU holds all of it
    return item.memory_mib if item.charge is None else item.charge[1]


def _holders(items: Sequence[Assignment]) -> str:
    if not items:
        return "nobody"
    shown = ", ".join(f"{a.label} {_cores_on(a)} cores/{a.memory_mib} MiB" for a in items[:4])
    return shown + (f" and {len(items) - 4} more" if len(items) > 4 else "")
