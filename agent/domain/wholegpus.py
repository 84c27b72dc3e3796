"""Which free GPUs a whole-GPU container (vcuda-core a multiple of 100) gets on a node.

The best-linked set wins: the highest weakest link, then the highest sum of links
(``placement.link_score``: any NVLink outranks every PCIe level), then the lowest
indexes. A ``vcuda-memory`` given with whole GPUs is a floor on the set's
schedulable MiB together. Up to ``MAX_SETS`` candidate sets are ranked exactly;
beyond that (e.g. 8 of 16 GPUs) one set is grown from every GPU along its best
links and those sets are ranked instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from math import comb

MAX_SETS = 5000

Rank = tuple[int, int, tuple[int, ...]]


def best_set(
    free: Sequence[int],
    count: int,
    memory_mib: int,
    memory: Mapping[int, int],
    links: Mapping[tuple[int, int], int],
) -> tuple[int, ...] | None:
    """The chosen GPU indexes among ``free``, or None when no ``count`` of them have
    ``memory_mib`` together. ``memory``: schedulable MiB per GPU; ``links``: link score per
    ordered pair (a missing pair scores 0)."""
    if len(free) < count or count < 1:
        return None
    candidates = sorted(free)
    largest = sorted(candidates, key=lambda i: (-memory[i], i))[:count]
    if sum(memory[i] for i in largest) < memory_mib:
        return None
    if count == 1:
        return next((i,) for i in candidates if memory[i] >= memory_mib)
    if comb(len(candidates), count) > MAX_SETS:
        sets: Sequence[tuple[int, ...]] = [_grow(seed, candidates, count, links) for seed in candidates]
    else:
        sets = list(itertools.combinations(candidates, count))
    best: tuple[Rank, tuple[int, ...]] | None = None
    for combo in sets:
        if memory_mib and sum(memory[i] for i in combo) < memory_mib:
            continue
        rank = _rank(combo, links)
        if best is None or rank < best[0]:
            best = (rank, combo)
    # Grown sets may all miss the memory floor while the largest GPUs meet it.
    return best[1] if best is not None else tuple(sorted(largest))


def _rank(combo: tuple[int, ...], links: Mapping[tuple[int, int], int]) -> Rank:
    pairs = [links.get(p, 0) for p in itertools.combinations(combo, 2)]
    return (-min(pairs), -sum(pairs), combo)


def _grow(
    seed: int, candidates: list[int], count: int, links: Mapping[tuple[int, int], int]
) -> tuple[int, ...]:
    chosen = [seed]
    pool = [i for i in candidates if i != seed]
    while len(chosen) < count:
        nxt = max(
            pool,
            key=lambda i: (
                min(links.get((i, j), 0) for j in chosen),
                sum(links.get((i, j), 0) for j in chosen),
                -i,
            ),
        )
        pool.remove(nxt)
        chosen.append(nxt)
    return tuple(sorted(chosen))
