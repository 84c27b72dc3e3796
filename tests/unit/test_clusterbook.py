"""The scheduler extender's book: fit edge cases, reasons, charges, reservations."""

from __future__ import annotations

import random

import pytest

from agent.domain.clusterbook import UNKNOWN_NODE, Assignment, ClusterBook, GpuUsage, NoFitError
from agent.domain.schedrequest import PackPolicy
from tests.unit.extenderbook import MIB, NOW, inventory, one, pod, share, use

BINPACK, SPREAD = PackPolicy.BINPACK, PackPolicy.SPREAD


def book_with(*nodes: tuple[str, int], **kwargs: float) -> ClusterBook:
    book = ClusterBook(**kwargs)  # type: ignore[arg-type]
    for name, count in nodes:
        book.set_node(name, inventory(name, count))
    return book


def reason(book: ClusterBook, demand_cores: int, memory: int, node: str = "n1", now: float = NOW) -> str:
    fit, failed = book.filter(one(demand_cores, memory), [node], now)
    assert fit == [] and list(failed) == [node]
    return failed[node]


def fits(book: ClusterBook, cores: int, memory: int, node: str = "n1") -> bool:
    fit, failed = book.filter(one(cores, memory), [node], NOW)
    assert (fit == [node]) != (node in failed)
    return fit == [node]


# Fit edge cases ---------------------------------------------------------------


def test_exact_fit_and_one_over() -> None:
    book = book_with(("n1", 1))
    use(book, "n1", 0, 50, MIB - 4000)
    assert fits(book, 50, 4000)  # cores and memory exactly equal to free
    assert reason(book, 50, 4001) == (
        "container c: no GPU has 50 vcuda-core and 4001 MiB free together "
        "(best: GPU 0 with 50 cores and 4000 MiB free)"
    )
    assert "no GPU has 51 vcuda-core and 4000 MiB" in reason(book, 51, 4000)


def test_fragmented_gpus_refuse_a_share_that_fits_only_the_total() -> None:
    book = book_with(("n1", 2))
    use(book, "n1", 0, 70, 100)
    use(book, "n1", 1, 70, 100)
    text = reason(book, 50, 1000)
    assert "no GPU has 50 vcuda-core and 1000 MiB free together (best: GPU 0 with 30 cores" in text
    assert "the node's 60 free vcuda-core are split across GPUs" in text
    assert fits(book, 30, 1000)


def test_memory_must_fit_one_gpu() -> None:
    book = book_with(("n1", 4))
    text = reason(book, 10, MIB + 1)
    assert f"needs {MIB + 1} MiB on one GPU, but the largest healthy GPU here has {MIB} MiB" in text


def test_unhealthy_gpu_is_never_used() -> None:
    book = ClusterBook()
    book.set_node("n1", inventory("n1", 2, unhealthy=[0]))
    use(book, "n1", 1, 80, 100)
    text = reason(book, 50, 100)
    assert "best: GPU 1 with 20 cores" in text and "GPU 0 is unhealthy" in text
    assert book.reserve("p", "n1", one(20, 100), SPREAD, NOW).gpus == {(False, 0): (1,)}
    book.set_node("n2", inventory("n2", 1, unhealthy=[0]))
    assert reason(book, 10, 10, "n2") == "container c: no GPU can take another container: GPU 0 is unhealthy"
    assert [u.healthy for u in book.gpu_usage("n1")] == [False, True]


def test_stale_heartbeat_makes_the_node_ineligible() -> None:
    book = ClusterBook(stale_after_s=90)
    book.set_node("n1", inventory("n1", heartbeat=NOW - 400))
    assert reason(book, 10, 10) == (
        "inventory heartbeat is 400 s old (stale after 90 s): is vcuda-agent running on the node?"
    )
    assert book.prioritize(one(10, 10), ["n1"], NOW, BINPACK, BINPACK) == {"n1": 0}
    with pytest.raises(NoFitError, match="400 s old"):
        book.reserve("p", "n1", one(10, 10), BINPACK, NOW)
    book.set_node("n1", inventory("n1", heartbeat=NOW - 90))  # exactly at the limit: still fresh
    assert fits(book, 10, 10)


def test_missing_malformed_and_unknown_nodes_have_reasons() -> None:
    book = ClusterBook()
    book.set_node("plain", None)
    book.set_node("broken", None, "nvidia.com/vcuda-inventory is not valid JSON: Expecting value")
    fit, failed = book.filter(one(10, 10), ["plain", "broken", "ghost"], NOW)
    assert fit == []
    assert failed == {
        "plain": "not managed: no nvidia.com/vcuda-inventory annotation",
        "broken": "nvidia.com/vcuda-inventory is not valid JSON: Expecting value",
        "ghost": UNKNOWN_NODE,
    }
    assert book.has_node("plain") and not book.has_node("ghost")
    assert book.gpu_usage("plain") == [] and book.gpu_usage("ghost") == []
    book.set_node("empty", inventory("empty", memory=[]))
    assert reason(book, 10, 10, "empty") == "the node's inventory lists no GPUs"


def test_max_containers_per_gpu() -> None:
    book = book_with(("n1", 1), ("n2", 2), max_per_gpu=2)
    use(book, "n1", 0, 10, 10)
    use(book, "n1", 0, 10, 10)
    assert "GPU 0 already runs 2 containers (the limit)" in reason(book, 10, 10)
    for uid in ("a", "b", "c"):
        book.reserve(uid, "n2", one(10, 10), BINPACK, NOW)
    assert [u.containers for u in book.gpu_usage("n2")] == [2, 1]


# Whole GPUs and topology ---------------------------------------------------------


def test_whole_gpus_need_empty_gpus() -> None:
    book = book_with(("n1", 4))
    use(book, "n1", 1, 1, 1)
    assert fits(book, 300, 0)
    assert reason(book, 400, 0) == (
        "container c: 4 whole GPUs needed, 3 free (GPUs 0, 2, 3 free; 1 healthy GPU(s) partly used)"
    )
    assignment = book.reserve("w", "n1", one(200), BINPACK, NOW)
    assert len(assignment.gpus[(False, 0)]) == 2
    usage = {u.index: u for u in book.gpu_usage("n1")}
    for i in assignment.gpus[(False, 0)]:
        assert usage[i] == GpuUsage(i, 100, 100, MIB, MIB, 1, True)  # takes all memory
    assert (
        reason(book, 200, 0)
        == "container c: 2 whole GPUs needed, 1 free (GPU 3 free; 3 healthy GPU(s) partly used)"
    )


def test_whole_gpus_prefer_an_nvlink_set() -> None:
    book = ClusterBook()
    book.set_node("n1", inventory("n1", 4, nvlinks={(1, 3): 4, (0, 2): 1}))
    assert book.reserve("a", "n1", one(200), BINPACK, NOW).gpus == {(False, 0): (1, 3)}
    assert book.reserve("b", "n1", one(200), BINPACK, NOW).gpus == {(False, 0): (0, 2)}
    book.set_node(
        "n2", inventory("n2", 8, nvlinks={(a, b): 2 for a in range(4, 8) for b in range(4, 8) if a < b})
    )
    assert book.reserve("c", "n2", one(400), SPREAD, NOW).gpus == {(False, 0): (4, 5, 6, 7)}


def test_whole_gpu_memory_counts_the_chosen_set() -> None:
    book = ClusterBook()
    book.set_node("n1", inventory("n1", memory=[1000, 8000, 3000]))
    assert book.reserve("a", "n1", one(100, 5000), BINPACK, NOW).gpus == {(False, 0): (1,)}
    assert reason(book, 200, 5000) == (
        "container c: 2 whole GPUs with 5000 MiB together needed; the 2 largest free GPUs have 4000 MiB"
    )
    assert book.reserve("b", "n1", one(200, 4000), BINPACK, NOW).gpus == {(False, 0): (0, 2)}


# Init containers and pods with several containers ------------------------------------------


def test_init_containers_fit_alone_and_are_not_charged() -> None:
    book = book_with(("n1", 1))
    use(book, "n1", 0, 40, 4000)
    demand = pod(share(60, 6000, "setup", 0, init=True), share(60, 6000, "app", 0))
    assignment = book.reserve("p", "n1", demand, BINPACK, NOW)
    assert assignment == Assignment("n1", {(True, 0): (0,), (False, 0): (0,)})
    assert book.gpu_usage("n1") == [GpuUsage(0, 100, 100, MIB, MIB, 2, True)]  # the app only
    book.uncharge("p")
    too_big = pod(share(70, 10, "setup", 0, init=True), share(10, 10, "app", 0))
    fit, failed = book.filter(too_big, ["n1"], NOW)
    assert fit == [] and failed["n1"].startswith("init container setup: no GPU has 70 vcuda-core")


def test_app_containers_are_placed_together() -> None:
    book = book_with(("n1", 2))
    two = pod(share(50, 100, "a", 0), share(50, 100, "b", 1))
    three = pod(share(60, 100, "a", 0), share(60, 100, "b", 1), share(60, 100, "c", 2))
    assert book.filter(two, ["n1"], NOW)[0] == ["n1"]
    text = book.filter(three, ["n1"], NOW)[1]["n1"]
    assert "no GPU has 60 vcuda-core" in text and "(after placing the pod's other containers)" in text
    mixed = pod(share(100, 0, "w", 0), share(50, 100, "s", 1))
    assignment = book.reserve("m", "n1", mixed, BINPACK, NOW)
    assert sorted(assignment.gpus.values()) == [(0,), (1,)]
    assert book.filter(pod(share(200, 0, "w", 0), share(10, 10, "s", 1)), ["n1"], NOW)[0] == []


# Scores and GPU choice ----------------------------------------------------------------


def test_node_binpack_prefers_fuller_nodes_and_spread_emptier() -> None:
    book = book_with(("full", 2), ("half", 2), ("empty", 2), ("no-room", 1))
    for gpu in (0, 1):
        use(book, "full", gpu, 80, 8000)
    use(book, "half", 0, 90, 9000)
    use(book, "no-room", 0, 95, 100)
    names = ["full", "half", "empty", "no-room"]
    demand = one(10, 1000)
    binpack = book.prioritize(demand, names, NOW, BINPACK, BINPACK)
    spread = book.prioritize(demand, names, NOW, SPREAD, BINPACK)
    assert binpack["full"] > binpack["half"] > binpack["empty"] >= 1
    assert spread["empty"] > spread["half"] > spread["full"] >= 1
    assert binpack["no-room"] == spread["no-room"] == 0
    assert all(0 <= s <= 10 for s in [*binpack.values(), *spread.values()])
    # the pod's annotation wins over the extender's default
    assert book.prioritize(one(10, 1000, node_policy=SPREAD), names, NOW, BINPACK, BINPACK) == spread


def test_equal_core_use_is_told_apart_by_memory() -> None:
    book = book_with(("light", 1), ("heavy", 1))
    use(book, "light", 0, 50, 500)
    use(book, "heavy", 0, 50, 9000)
    scores = book.prioritize(one(10, 100), ["light", "heavy"], NOW, BINPACK, BINPACK)
    assert scores["heavy"] > scores["light"]


@pytest.mark.parametrize(
    ("policy", "cores", "expected"),
    [
        pytest.param(BINPACK, 25, 0, id="binpack-tightest"),
        pytest.param(BINPACK, 50, 1, id="binpack-skips-too-small"),
        pytest.param(SPREAD, 25, 2, id="spread-emptiest"),
        pytest.param(SPREAD, 71, 2, id="spread-only-fit"),
    ],
)
def test_gpu_policy_picks_the_gpu(policy: PackPolicy, cores: int, expected: int) -> None:
    book = book_with(("n1", 3))
    use(book, "n1", 0, 70, 100)
    use(book, "n1", 1, 30, 100)
    assert book.reserve("p", "n1", one(cores, 100), policy, NOW).gpus == {(False, 0): (expected,)}


def test_gpu_ties_and_the_pod_gpu_annotation() -> None:
    book = book_with(("n1", 3))
    use(book, "n1", 1, 50, 100)
    use(book, "n1", 2, 50, 200)
    assert book.reserve("a", "n1", one(10, 10), BINPACK, NOW).gpus[(False, 0)] == (2,)  # less memory
    book.uncharge("a")
    spread_pod = one(10, 10, gpu_policy=SPREAD)
    assert book.reserve("b", "n1", spread_pod, BINPACK, NOW).gpus[(False, 0)] == (0,)
    book.set_node("n2", inventory("n2", 3))
    assert book.reserve("c", "n2", one(10, 10), BINPACK, NOW).gpus[(False, 0)] == (0,)  # lowest index


# Charges -----------------------------------------------------------------------------


def test_charge_is_idempotent_and_uncharge_tolerant() -> None:
    book = book_with(("n1", 1))
    demand = one(30, 300)
    for _ in range(3):
        book.charge("p", "n1", demand, {(False, 0): (0,)})
    assert book.gpu_usage("n1") == [GpuUsage(0, 30, 100, 300, MIB, 1, True)]
    assert book.charge_of("p") == Assignment("n1", {(False, 0): (0,)})
    book.uncharge("p")
    book.uncharge("p")
    book.uncharge("never-seen")
    assert book.gpu_usage("n1") == [GpuUsage(0, 0, 100, 0, MIB, 0, True)]
    assert book.charge_of("p") is None


def test_charges_with_unknown_gpus_hold_the_node_totals() -> None:
    book = book_with(("n1", 1))
    book.charge("p", "n1", one(60, 1000), {})
    assert book.pending_of("n1") == (1, 60, 1000)
    assert book.gpu_usage("n1")[0].cores_used == 0
    text = reason(book, 50, 100)
    assert "1 container(s) on this node have no GPU assigned yet (60 vcuda-core, 1000 MiB)" in text
    assert "the node has 40 vcuda-core and 9000 MiB free in total, the pod needs 50 and 100" in text
    assert fits(book, 40, 100)
    book.charge("p", "n1", one(60, 1000), {(False, 0): (0,)})  # the agent annotated it
    assert book.pending_of("n1") == (0, 0, 0)
    assert book.gpu_usage("n1")[0].cores_used == 60
    book.charge("q", "n1", one(10, 10), {(False, 0): (7,)})  # a GPU the node does not list
    assert book.pending_of("n1") == (1, 10, 10)


def test_pending_whole_gpus_hold_empty_gpus() -> None:
    book = book_with(("n1", 2))
    book.charge("w", "n1", one(100), {})
    use(book, "n1", 0, 10, 10)
    assert "they need 1 empty GPUs, 0 would be left" in reason(book, 100, 0)
    assert fits(book, 10, 10)  # binpack keeps GPU 1 empty for the pending one


def test_charges_survive_node_updates_and_may_come_first() -> None:
    book = ClusterBook()
    book.charge("early", "n1", one(30, 300), {(False, 0): (1,)})
    assert book.gpu_usage("n1") == []
    book.set_node("n1", inventory("n1", 2))
    assert [u.cores_used for u in book.gpu_usage("n1")] == [0, 30]
    book.set_node("n1", inventory("n1", 2, heartbeat=NOW + 30))  # heartbeat only
    book.set_node("n1", inventory("n1", 3, heartbeat=NOW + 60))  # a GPU appeared
    assert [u.cores_used for u in book.gpu_usage("n1")] == [0, 30, 0]
    book.remove_node("n1")
    assert not book.has_node("n1") and book.charge_of("early") is not None
    book.set_node("n1", inventory("n1", 2, heartbeat=NOW + 90))
    assert [u.cores_used for u in book.gpu_usage("n1")] == [0, 30]
    book.uncharge("early")
    assert [u.cores_used for u in book.gpu_usage("n1")] == [0, 0]


# Reservations ------------------------------------------------------------------------


def test_filter_sees_a_reservation() -> None:
    book = book_with(("n1", 1))
    assert fits(book, 50, 100)
    book.reserve("p", "n1", one(60, 100), BINPACK, NOW)
    assert "best: GPU 0 with 40 cores" in reason(book, 50, 100)


def test_the_second_reservation_of_the_last_capacity_fails() -> None:
    book = book_with(("n1", 1))
    use(book, "n1", 0, 50, 100)
    book.reserve("a", "n1", one(50, 100), BINPACK, NOW)
    with pytest.raises(NoFitError, match="no GPU has 50 vcuda-core and 100 MiB free together"):
        book.reserve("b", "n1", one(50, 100), BINPACK, NOW)
    assert book.charge_of("b") is None
    assert book.reserve("a", "n1", one(50, 100), SPREAD, NOW).gpus == {(False, 0): (0,)}  # replaces
    with pytest.raises(NoFitError):
        book.reserve("a", "n1", one(60, 100), BINPACK, NOW)
    assert book.charge_of("a") == Assignment("n1", {(False, 0): (0,)})  # the old one is kept
    assert book.gpu_usage("n1")[0].cores_used == 100


def test_fifty_reservations_never_oversubscribe_a_gpu() -> None:
    book = book_with(("n1", 1))
    won = []
    for i in range(50):
        try:
            book.reserve(f"p{i}", "n1", one(7, 100), BINPACK, NOW)
            won.append(i)
        except NoFitError:
            pass
    assert len(won) == 14  # 14 x 7 = 98 cores; the 15th would need 105
    assert book.gpu_usage("n1") == [GpuUsage(0, 98, 100, 1400, MIB, 14, True)]


def test_filter_and_reserve_agree_on_random_pods() -> None:
    """Whatever filter accepts, reserve (either policy) places without exceeding any GPU."""
    rng = random.Random(7)
    book = ClusterBook(max_per_gpu=4)
    names = [f"n{i}" for i in range(6)]
    for name in names:
        book.set_node(name, inventory(name, 4))
    for i in range(300):
        containers = [
            share(rng.choice([10, 25, 40, 60, 90, 100, 200]), rng.choice([0, 500, 2500, 6000]), f"c{k}", k)
            for k in range(rng.choice([1, 1, 2, 3]))
        ]
        containers = [
            c if c.cores >= 100 or c.memory_mib else share(c.cores, 100, c.name, c.index) for c in containers
        ]
        demand = pod(*containers, gpu_policy=rng.choice([BINPACK, SPREAD]))
        fit, failed = book.filter(demand, names, NOW)
        assert sorted(fit + list(failed)) == sorted(names)
        scores = book.prioritize(demand, names, NOW, BINPACK, BINPACK)
        assert {n for n, s in scores.items() if s > 0} == set(fit)
        for name in names:
            try:
                book.reserve(f"p{i}", name, demand, BINPACK, NOW)
            except NoFitError:
                assert name in failed
                continue
            assert name in fit
            break
        for name in names:
            for u in book.gpu_usage(name):
                assert u.cores_used <= u.cores_total and u.memory_used_mib <= u.memory_total_mib
                assert u.containers <= 4
        if rng.random() < 0.3:
            book.uncharge(f"p{rng.randrange(i + 1)}")
