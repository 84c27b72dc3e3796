"""The allocation ledger: who holds how many cores and MiB on which GPU."""

from __future__ import annotations

import pytest

from agent.domain.ledger import Assignment, Ledger
from agent.errors import InsufficientCapacityError
from tests.unit.kubefixtures import make_gpus


def share(pod: str, container: str, gpu: int, cores: int, memory: int, *, init: bool = False) -> Assignment:
    return Assignment(f"uid-{pod}", "default", pod, container, init, (gpu,), cores, memory)


def test_shares_add_up_and_release() -> None:
    ledger = Ledger(make_gpus(1, memory_mib=10_000))
    ledger.assign(share("a", "c", 0, 30, 4000))
    ledger.assign(share("b", "c", 0, 50, 5000))
    usage = ledger.usage(0)
    assert (usage.cores, usage.memory_mib) == (80, 9000)
    assert ledger.free(0) == (20, 1000)
    assert [a.label for a in ledger.release("uid-a")] == ["default/a/c"]
    assert ledger.free(0) == (50, 5000)


@pytest.mark.parametrize(
    ("cores", "memory", "what"),
    [(21, 100, "21 vcuda-core"), (20, 1001, "1001 MiB")],
)
def test_oversubscription_is_refused_with_the_numbers(cores: int, memory: int, what: str) -> None:
    ledger = Ledger(make_gpus(1, memory_mib=10_000))
    ledger.assign(share("a", "c", 0, 80, 9000))
    with pytest.raises(InsufficientCapacityError) as err:
        ledger.assign(share("b", "c", 0, cores, memory))
    text = str(err.value)
    assert what in text and "20 cores and 1000 MiB" in text and "default/a/c" in text
    assert ledger.get("uid-b", "c") is None  # nothing recorded


def test_exact_fit_is_accepted() -> None:
    ledger = Ledger(make_gpus(1, memory_mib=10_000))
    ledger.assign(share("a", "c", 0, 60, 6000))
    ledger.assign(share("b", "c", 0, 40, 4000))
    assert ledger.free(0) == (0, 0)


def test_scaling_shrinks_memory_capacity_and_is_read_live() -> None:
    scale = [0.5]
    ledger = Ledger(make_gpus(1, memory_mib=10_000), scaling=lambda: scale[0])
    with pytest.raises(InsufficientCapacityError):
        ledger.assign(share("a", "c", 0, 10, 6000))
    scale[0] = 1.0
    ledger.assign(share("a", "c", 0, 10, 6000))


def test_whole_gpu_takes_everything_even_with_scaling() -> None:
    ledger = Ledger(make_gpus(2, memory_mib=10_000), scaling=lambda: 0.9)
    ledger.assign(Assignment("uid-w", "default", "w", "c", False, (0, 1), 200, 0))
    assert ledger.free(0) == (0, 0) and ledger.free(1) == (0, 0)
    with pytest.raises(InsufficientCapacityError):
        ledger.assign(share("b", "c", 1, 1, 1))


def test_init_containers_do_not_count_against_their_own_pod() -> None:
    ledger = Ledger(make_gpus(1, memory_mib=10_000))
    ledger.assign(share("p", "init-1", 0, 60, 6000, init=True))
    ledger.assign(share("p", "init-2", 0, 60, 6000, init=True))  # runs after init-1
    ledger.assign(share("p", "app", 0, 60, 6000))  # runs after both
    assert ledger.usage(0).cores == 60  # max(sum app, max init)
    with pytest.raises(InsufficientCapacityError):
        ledger.assign(share("other", "app", 0, 50, 100))  # other pods see the pod's 60


def test_reassigning_a_container_replaces_it_and_keeps_old_on_failure() -> None:
    ledger = Ledger(make_gpus(1, memory_mib=10_000))
    ledger.assign(share("a", "c", 0, 50, 5000))
    ledger.assign(share("a", "c", 0, 60, 5000))
    assert ledger.usage(0).cores == 60
    ledger.assign(share("b", "c", 0, 40, 1000))
    with pytest.raises(InsufficientCapacityError):
        ledger.assign(share("a", "c", 0, 70, 5000))
    assert ledger.get("uid-a", "c") == share("a", "c", 0, 60, 5000)


def test_device_ids_find_their_holder_and_are_dropped_on_release() -> None:
    ledger = Ledger(make_gpus(1))
    item = Assignment("uid-a", "default", "a", "c", False, (0,), 2, 10, frozenset({"x", "y"}))
    ledger.assign(item)
    assert ledger.holder_of("x") == item
    ledger.release("uid-a", "c")
    assert ledger.holder_of("x") is None


def test_replace_all_skips_what_does_not_fit_and_says_so() -> None:
    ledger = Ledger(make_gpus(1, memory_mib=1000))
    problems = ledger.replace_all([share("a", "c", 0, 80, 500), share("b", "c", 0, 30, 100)])
    assert len(ledger.assignments()) == 1
    assert len(problems) == 1 and "default/b/c" in problems[0]
