"""GetPreferredAllocation: which IDs a container should get.

A share of one GPU (< 100) goes to the GPU with the fewest free units that still
fits it (binpack, so whole GPUs stay free). Whole GPUs (multiples of 100) go to
the set of fully free GPUs with the best links: NVLink > same PCIe switch > same
NUMA node > across sockets; among equal sets, the one that breaks up the fewest
good links between the GPUs left free.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from math import comb
from operator import itemgetter

from agent.domain.ids import UNITS_PER_GPU, IdTable
from agent.domain.requests import check_core_request, is_whole
from agent.errors import AllocationError, InsufficientCapacityError
from agent.platform.gpu.inventory import GpuInfo, Link, Topology

_MAX_COMBINATIONS = 20_000  # beyond this, whole-GPU sets are chosen greedily
_CACHE_SIZE = 4096  # whole-GPU choices remembered per (free GPUs, count, must-include)


def link_score(link: Link) -> int:
    """One number per link; any NVLink outranks every PCIe level (levels are 0..5)."""
    return link.nvlinks * 10 + int(link.level)


class Placer:
    """Placement over one node's GPUs; build once, call per request."""

    def __init__(self, gpus: Sequence[GpuInfo], topology: Topology, table: IdTable | None = None) -> None:
        self.gpus = tuple(gpus)
        self.table = table or IdTable(self.gpus)
        self._by_index = {g.index: g for g in self.gpus}
        self._score = {
            (a.index, b.index): link_score(topology.link(a.index, b.index))
            for a in self.gpus
            for b in self.gpus
            if a.index != b.index
        }
        self._cache: dict[tuple[tuple[int, ...], int, tuple[int, ...]], tuple[int, ...]] = {}

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        check_core_request(size)
        # kubelet sends distinct IDs; a repeated one must neither repeat in the answer nor count twice.
        available, must_include = list(dict.fromkeys(available)), list(dict.fromkeys(must_include))
        if len(must_include) > size:
            raise AllocationError(f"{len(must_include)} must-include IDs do not fit a request of {size}")
        if must_include and not set(must_include) <= set(available):
            missing = sorted(set(must_include) - set(available))
            raise AllocationError(f"must-include IDs {missing} are not among the available IDs")
        where = self.table.locate_all(available)
        free = Counter(map(itemgetter(0), where))
        must_gpus = {index for index, _ in self.table.locate_all(must_include)}
        if is_whole(size):
            chosen = self._whole_gpus(free, size // UNITS_PER_GPU, must_gpus)
            return [
                d for i in chosen for d in self.table.ids_by_gpu[i]
            ]  # a fully free GPU offers all its IDs
        gpu = self._share_gpu(free, must_gpus, size)
        slots: list[str | None] = [None] * UNITS_PER_GPU  # unit order without sorting
        for (index, unit), device_id in zip(where, available, strict=True):
            if index == gpu:
                slots[unit] = device_id
        required = set(must_include)
        extra = [d for d in slots if d is not None and d not in required]
        return list(must_include) + extra[: size - len(must_include)]

    def _share_gpu(self, free: Counter[int], must_gpus: set[int], size: int) -> int:
        if len(must_gpus) > 1:
            raise AllocationError(
                f"must-include IDs span GPUs {sorted(must_gpus)}: a request of {size} must come from one GPU"
            )
        candidates = [
            g.index for g in self.gpus if free[g.index] >= size and (not must_gpus or g.index in must_gpus)
        ]
        if not candidates:
            listing = ", ".join(f"GPU {g.index}: {free[g.index]}" for g in self.gpus)
            raise InsufficientCapacityError(
                f"no single GPU has {size} free vcuda-core units (free per GPU: {listing}); "
                "a request below 100 must fit on one GPU"
            )
        return min(candidates, key=lambda i: (free[i], i))

    def _whole_gpus(self, free: Counter[int], count: int, must: set[int]) -> tuple[int, ...]:
        fully_free = tuple(g.index for g in self.gpus if free[g.index] == UNITS_PER_GPU)
        if len(must) > count:
            raise AllocationError(f"must-include IDs span GPUs {sorted(must)}, more than {count} requested")
        partial_must = must - set(fully_free)
        if partial_must:
            raise AllocationError(f"must-include GPUs {sorted(partial_must)} are not fully free")
        if len(fully_free) < count:
            raise InsufficientCapacityError(
                f"{count} whole GPUs requested but only {len(fully_free)} are fully free "
                f"({', '.join(map(str, fully_free)) or 'none'})"
            )
        key = (fully_free, count, tuple(sorted(must)))
        chosen = self._cache.get(key)
        if chosen is None:
            chosen = self._best_set(list(fully_free), count, must)
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = chosen
        return chosen

    def _best_set(self, fully_free: list[int], count: int, must: set[int]) -> tuple[int, ...]:
        others = [i for i in fully_free if i not in must]
        need = count - len(must)
        if comb(len(others), need) > _MAX_COMBINATIONS:
            return tuple(sorted(self._greedy(sorted(must), others, need)))
        score = self._score

        def rank(extra: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
            chosen = sorted(must.union(extra))
            pairs = [score[a, b] for a, b in itertools.combinations(chosen, 2)]
            spared = [i for i in fully_free if i not in chosen]
            # Among equal sets, break up the fewest good links between GPUs left free.
            damage = sum(max((score[c, s] for s in spared), default=0) for c in chosen)
            return (-min(pairs, default=0), -sum(pairs), damage, tuple(chosen))

        best = min(itertools.combinations(others, need), key=rank)
        return tuple(sorted(must.union(best)))

    def _greedy(self, chosen: list[int], others: list[int], need: int) -> list[int]:
        pool = list(others)
        if not chosen and need:
            chosen.append(pool.pop(0))
            need -= 1
        for _ in range(need):
            nxt = max(pool, key=lambda i: (min(self._score[i, c] for c in chosen), -i))
            pool.remove(nxt)
            chosen.append(nxt)
        return chosen


def preferred_allocation(
    gpus: Sequence[GpuInfo],
    topology: Topology,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """One-off form of ``Placer(gpus, topology).preferred(...)``."""
    return Placer(gpus, topology).preferred(available, must_include, size)
