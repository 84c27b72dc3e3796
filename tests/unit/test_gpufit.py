"""One node's fit, GPU choice, summaries and score (agent.domain.gpufit)."""

from __future__ import annotations

import random

import pytest

from agent.domain.gpufit import NodeState, Shape, choose_share
from agent.domain.schedrequest import PackPolicy
from tests.unit.extenderbook import MIB, inventory, one, pod, share

BINPACK, SPREAD = PackPolicy.BINPACK, PackPolicy.SPREAD


def node(count: int = 4, max_per_gpu: int = 16, **kwargs: object) -> NodeState:
    state = NodeState("n1", inventory("n1", count, **kwargs), "")  # type: ignore[arg-type]
    state.refresh(max_per_gpu)
    return state


def take(state: NodeState, gpu: int, cores: int, memory: int, containers: int = 1) -> None:
    g = state.gpus[gpu]
    g.used_cores += cores
    g.used_memory += memory
    g.containers += containers
    state.dirty = True
    state.refresh(state.max_per_gpu)


@pytest.mark.parametrize(
    ("shares", "policy", "expected"),
    [
        pytest.param([(30, 100, 0), (70, 100, 1), (100, 100, 2)], BINPACK, 0, id="binpack-least-free"),
        pytest.param([(30, 100, 0), (70, 100, 1), (100, 100, 2)], SPREAD, 2, id="spread-most-free"),
        pytest.param([(50, 300, 0), (50, 200, 1)], BINPACK, 1, id="binpack-tie-least-memory"),
        pytest.param([(50, 300, 0), (50, 200, 1)], SPREAD, 0, id="spread-tie-most-memory"),
        pytest.param([(50, 200, 3), (50, 200, 1)], BINPACK, 1, id="binpack-tie-lowest-index"),
        pytest.param([(50, 200, 3), (50, 200, 1)], SPREAD, 1, id="spread-tie-lowest-index"),
        pytest.param([(100, 10, 0), (25, 100, 1)], BINPACK, 1, id="memory-must-fit-too"),
        pytest.param([(24, 100, 0), (100, 99, 1)], SPREAD, None, id="nothing-fits"),
    ],
)
def test_choose_share(shares: list[tuple[int, int, int]], policy: PackPolicy, expected: int | None) -> None:
    assert choose_share(shares, share(25, 100), policy) == expected


def test_summaries_follow_usage() -> None:
    state = node(3, max_per_gpu=2, unhealthy=[2])
    assert (state.max_cores, state.max_memory, state.empty) == (100, MIB, [0, 1])
    assert state.blocked == ["GPU 2 is unhealthy"]
    take(state, 0, 60, 1000, containers=2)
    assert state.shares == [(100, MIB, 1)]  # GPU 0 is at the container limit
    assert state.empty == [1]
    assert state.blocked == ["GPU 2 is unhealthy", "GPU 0 already runs 2 containers (the limit)"]
    assert (state.healthy_cores, state.used_cores, state.used_memory) == (200, 60, 1000)


def test_quick_answers_match_the_full_fit() -> None:
    state = node(2)
    take(state, 0, 70, 100)
    take(state, 1, 40, 9000)
    for cores, memory in [(30, 9900), (30, 9901), (60, 1000), (60, 1001), (71, 1), (100, 0), (200, 0)]:
        demand = one(cores, memory)
        quick = state.fits_quickly(Shape(demand))
        full = state.fit(demand, BINPACK)[0] is not None
        assert quick is None or quick == full, (cores, memory)
    assert state.fits_quickly(Shape(pod(share(10, 10, "a", 0), share(10, 10, "b", 1)))) is True
    assert (
        state.fits_quickly(Shape(pod(share(46, 10, "a", 0), share(46, 10, "b", 1)))) is False
    )  # 92 > 90 free


def test_quick_answers_never_contradict_the_full_fit() -> None:
    rng = random.Random(3)
    sizes = [(10, 100), (25, 2500), (40, 4000), (60, 100), (90, 9000), (100, 0), (200, 0), (100, 9000)]
    for _ in range(400):
        state = node(4, max_per_gpu=3)
        for gpu in range(4):
            for _ in range(rng.randrange(3)):
                take(state, gpu, rng.choice([0, 10, 30]), rng.choice([0, 1000, 3000]))
        count = rng.choice([1, 2, 3])
        apps = [share(*rng.choice(sizes), f"c{k}", k) for k in range(count)]
        inits = [share(*rng.choice(sizes[:5]), "i", 0, init=True)] if rng.random() < 0.3 else []
        demand = pod(*inits, *apps)
        quick = state.fits_quickly(Shape(demand))
        if quick is not None:
            assert quick == (state.fit(demand, BINPACK)[0] is not None), demand
            assert quick == (state.fit(demand, SPREAD)[0] is not None), demand


def test_score_bounds_and_direction() -> None:
    state = node(1)
    small, big = Shape(one(10, 100)), Shape(one(90, 9000))
    # fill = (3 x core fill + memory fill) / 4 after placing; score = 1 + round(9 x fill)
    assert (state.score(small, spread=False), state.score(big, spread=False)) == (2, 9)
    assert (state.score(small, spread=True), state.score(big, spread=True)) == (9, 2)
    whole = Shape(one(100))
    assert state.score(whole, spread=False) == 10  # a whole GPU counts all its memory
    assert NodeState("x", inventory("x", memory=[]), "").score(small, spread=False) == 1
