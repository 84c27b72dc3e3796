"""Which free GPUs a whole-GPU container gets (agent.domain.wholegpus)."""

from __future__ import annotations

import math

import pytest

from agent.domain import wholegpus
from agent.domain.wholegpus import best_set


def links_of(pairs: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    both = dict(pairs)
    both.update({(b, a): s for (a, b), s in pairs.items()})
    return both


MEM = dict.fromkeys(range(16), 1000)


def test_nvlink_pair_beats_lower_indexes() -> None:
    links = links_of({(0, 1): 4, (2, 3): 40, (0, 2): 4})
    assert best_set([0, 1, 2, 3], 2, 0, MEM, links) == (2, 3)


def test_weakest_link_counts_before_the_sum() -> None:
    # {0,1,2}: 40, 40, 0 (weakest 0, sum 80); {0,1,3}: 40, 10, 10 (weakest 10, sum 60)
    links = links_of({(0, 1): 40, (0, 2): 40, (0, 3): 10, (1, 3): 10})
    assert best_set([0, 1, 2, 3], 3, 0, MEM, links) == (0, 1, 3)


def test_ties_take_the_lowest_indexes_and_single_gpus_the_first_fitting() -> None:
    assert best_set([5, 3, 4], 2, 0, MEM, {}) == (3, 4)
    memory = {0: 500, 1: 2000, 2: 3000}
    assert best_set([0, 1, 2], 1, 0, memory, {}) == (0,)
    assert best_set([0, 1, 2], 1, 1500, memory, {}) == (1,)


def test_memory_floor_and_too_few_gpus() -> None:
    memory = {0: 500, 1: 2000, 2: 3000}
    links = links_of({(0, 1): 40})
    assert best_set([0, 1, 2], 2, 2600, memory, links) == (0, 2)  # the NVLink pair lacks memory
    assert best_set([0, 1, 2], 2, 5001, memory, links) is None
    assert best_set([0, 1], 3, 0, memory, links) is None


def test_many_gpus_grow_sets_along_the_best_links() -> None:
    # C(16, 8) = 12870 sets: more than are ranked exactly.
    assert math.comb(16, 8) > wholegpus.MAX_SETS
    links = links_of({(a, b): 4 for a in range(8, 16) for b in range(8, 16) if a < b})
    assert best_set(list(range(16)), 8, 0, MEM, links) == tuple(range(8, 16))


@pytest.mark.parametrize("memory_mib", [0, 8000])
def test_grown_sets_meet_the_memory_floor(memory_mib: int) -> None:
    memory = {i: (1000 if i < 8 else 100) for i in range(16)}
    links = links_of({(a, b): 4 for a in range(8, 16) for b in range(8, 16) if a < b})
    chosen = best_set(list(range(16)), 8, memory_mib, memory, links)
    assert chosen is not None and len(chosen) == 8
    assert sum(memory[i] for i in chosen) >= memory_mib
