"""GetPreferredAllocation: binpack for shares, best-linked fully free GPUs for whole ones."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from agent.domain import placement
from agent.domain.ids import decode, encode, ids_for_gpu
from agent.domain.placement import preferred_allocation
from agent.errors import AllocationError, DeviceIdError, InsufficientCapacityError
from agent.platform.gpu.inventory import GpuInfo, Link, Topology, TopologyLevel
from agent.platform.gpu.sim.inventory import sim_topology
from agent.platform.gpu.sim.spec import parse_simulate_spec


def make_gpus(count: int) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=i,
            uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
            model="NVIDIA H100 80GB HBM3",
            memory_mib=81920,
            minor=i,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=0 if i < count / 2 else 1,
        )
        for i in range(count)
    ]


def free_ids(gpus: Sequence[GpuInfo], free: Sequence[int]) -> list[str]:
    """The last ``free[i]`` units of GPU i are available (the first ones are taken)."""
    return [encode(g.uuid, u) for g, n in zip(gpus, free, strict=True) for u in range(100 - n, 100)]


def gpus_of(gpus: Sequence[GpuInfo], ids: Iterable[str]) -> set[int]:
    by_uuid = {g.uuid: g.index for g in gpus}
    return {by_uuid[decode(i).gpu_uuid] for i in ids}


def check_valid(result: list[str], available: Sequence[str], size: int) -> None:
    assert len(result) == size
    assert len(set(result)) == size
    assert set(result) <= set(available)


H100X8 = sim_topology(parse_simulate_spec("8xH100-80GB"))
NO_LINKS = Topology()


# Shares of one GPU ---------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "size", "expected_gpu"),
    [
        pytest.param([30, 70, 100], 25, 0, id="25-fits-tightest-30"),
        pytest.param([30, 70, 100], 30, 0, id="30-exactly-fills-30"),
        pytest.param([30, 70, 100], 50, 1, id="50-skips-30-takes-70"),
        pytest.param([30, 70, 100], 71, 2, id="71-needs-a-free-gpu"),
        pytest.param([100, 30, 70], 25, 1, id="order-does-not-matter"),
        pytest.param([70, 70, 100], 50, 0, id="tie-lowest-index"),
        pytest.param([100, 100, 70, 70], 50, 2, id="tie-among-partial-lowest-index"),
        pytest.param([0, 0, 99], 99, 2, id="99-on-the-only-gpu-with-room"),
        pytest.param([100, 100, 100], 1, 0, id="all-free-lowest-index"),
    ],
)
def test_share_binpacks_onto_fewest_free_units(free: list[int], size: int, expected_gpu: int) -> None:
    gpus = make_gpus(len(free))
    available = free_ids(gpus, free)
    result = preferred_allocation(gpus, NO_LINKS, available, [], size)
    check_valid(result, available, size)
    assert gpus_of(gpus, result) == {expected_gpu}


def test_share_must_include_forces_its_gpu() -> None:
    gpus = make_gpus(3)
    available = free_ids(gpus, [30, 70, 100])
    must = [encode(gpus[2].uuid, 55)]
    result = preferred_allocation(gpus, NO_LINKS, available, must, 25)
    check_valid(result, available, 25)
    assert must[0] in result
    assert gpus_of(gpus, result) == {2}


def test_share_must_include_several_ids_all_kept() -> None:
    gpus = make_gpus(2)
    available = free_ids(gpus, [100, 100])
    must = [encode(gpus[1].uuid, u) for u in (90, 3, 47)]
    result = preferred_allocation(gpus, NO_LINKS, available, must, 10)
    check_valid(result, available, 10)
    assert set(must) <= set(result)
    assert gpus_of(gpus, result) == {1}


def test_share_must_include_spanning_gpus_is_an_error() -> None:
    gpus = make_gpus(2)
    available = free_ids(gpus, [100, 100])
    must = [encode(gpus[0].uuid, 0), encode(gpus[1].uuid, 0)]
    with pytest.raises(AllocationError, match=r"span GPUs \[0, 1\]"):
        preferred_allocation(gpus, NO_LINKS, available, must, 10)


def test_share_must_include_on_a_gpu_too_full_is_insufficient() -> None:
    gpus = make_gpus(2)
    available = free_ids(gpus, [10, 100])
    must = [encode(gpus[0].uuid, 95)]
    with pytest.raises(InsufficientCapacityError):
        preferred_allocation(gpus, NO_LINKS, available, must, 20)


def test_must_include_not_available_is_an_error() -> None:
    gpus = make_gpus(2)
    available = free_ids(gpus, [50, 100])
    must = [encode(gpus[0].uuid, 0)]  # taken: GPU 0's free units are 50..99
    with pytest.raises(AllocationError, match="not among the available"):
        preferred_allocation(gpus, NO_LINKS, available, must, 10)


def test_share_no_gpu_fits_lists_free_units_per_gpu() -> None:
    gpus = make_gpus(3)
    available = free_ids(gpus, [30, 45, 0])
    with pytest.raises(InsufficientCapacityError) as info:
        preferred_allocation(gpus, NO_LINKS, available, [], 50)
    message = str(info.value)
    assert "GPU 0: 30" in message
    assert "GPU 1: 45" in message
    assert "GPU 2: 0" in message


def test_unknown_gpu_in_available_is_a_device_id_error() -> None:
    gpus = make_gpus(1)
    available = [*free_ids(gpus, [100]), encode("GPU-ffffffff-aaaa-bbbb-cccc-dddddddddddd", 0)]
    with pytest.raises(DeviceIdError):
        preferred_allocation(gpus, NO_LINKS, available, [], 10)


@pytest.mark.parametrize("size", [0, -5, 150, 250])
def test_invalid_sizes_are_rejected(size: int) -> None:
    gpus = make_gpus(8)
    with pytest.raises(AllocationError):
        preferred_allocation(gpus, H100X8, free_ids(gpus, [100] * 8), [], size)


# Whole GPUs ----------------------------------------------------------------


def test_sim_topology_of_8xh100_is_as_documented() -> None:
    """The assumptions below: NVLinked pairs (2k, 2k+1), NUMA 0 = GPUs 0-3."""
    for a, b in [(0, 1), (2, 3), (4, 5), (6, 7)]:
        assert H100X8.link(a, b).nvlinks > 0
    assert H100X8.link(0, 2) == Link(TopologyLevel.NODE)
    assert H100X8.link(5, 7) == Link(TopologyLevel.NODE)
    assert H100X8.link(3, 4) == Link(TopologyLevel.SYSTEM)


def test_200_all_free_takes_an_nvlinked_pair() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [100] * 8)
    result = preferred_allocation(gpus, H100X8, available, [], 200)
    check_valid(result, available, 200)
    chosen = sorted(gpus_of(gpus, result))
    assert len(chosen) == 2
    assert H100X8.link(*chosen).nvlinks > 0
    assert chosen == [0, 1]  # ties go to the lowest indexes


def test_200_with_gpu0_partly_used_takes_pair_2_3() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [60] + [100] * 7)
    result = preferred_allocation(gpus, H100X8, available, [], 200)
    check_valid(result, available, 200)
    assert gpus_of(gpus, result) == {2, 3}


def test_400_takes_one_numa_nodes_four_gpus() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [100] * 8)
    result = preferred_allocation(gpus, H100X8, available, [], 400)
    check_valid(result, available, 400)
    assert gpus_of(gpus, result) in ({0, 1, 2, 3}, {4, 5, 6, 7})


def test_400_with_numa0_partly_used_takes_numa1() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [100, 100, 100, 99, 100, 100, 100, 100])
    result = preferred_allocation(gpus, H100X8, available, [], 400)
    assert gpus_of(gpus, result) == {4, 5, 6, 7}


def test_800_takes_everything() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [100] * 8)
    result = preferred_allocation(gpus, H100X8, available, [], 800)
    assert sorted(result) == sorted(available)


# GPUs 0-1 across sockets, 1-2 on one NUMA node, 2-3 behind one PCIe switch; the rest SYSTEM.
PCIE = Topology(
    {
        (0, 1): Link(TopologyLevel.SYSTEM),
        (1, 2): Link(TopologyLevel.NODE),
        (2, 3): Link(TopologyLevel.SINGLE_SWITCH),
    }
)


@pytest.mark.parametrize(
    ("free", "expected"),
    [
        pytest.param([100, 100, 100, 100], {2, 3}, id="single-switch-beats-all"),
        pytest.param([100, 100, 100, 50], {1, 2}, id="node-beats-system"),
        pytest.param([100, 100, 50, 100], {0, 1}, id="only-system-left-lowest-index"),
    ],
)
def test_pcie_only_prefers_closer_links(free: list[int], expected: set[int]) -> None:
    gpus = make_gpus(4)
    available = free_ids(gpus, free)
    result = preferred_allocation(gpus, PCIE, available, [], 200)
    check_valid(result, available, 200)
    assert gpus_of(gpus, result) == expected


def test_one_whole_gpu_keeps_an_nvlink_pair_intact() -> None:
    gpus = make_gpus(3)
    topology = Topology({(0, 1): Link(TopologyLevel.SINGLE_SWITCH, 12)})  # GPU 2: SYSTEM to both
    available = free_ids(gpus, [100, 100, 100])
    result = preferred_allocation(gpus, topology, available, [], 100)
    check_valid(result, available, 100)
    assert gpus_of(gpus, result) == {2}


def test_whole_gpu_must_include_forces_its_gpu() -> None:
    gpus = make_gpus(8)
    available = free_ids(gpus, [100] * 8)
    must = [encode(gpus[5].uuid, 0)]
    result = preferred_allocation(gpus, H100X8, available, must, 200)
    check_valid(result, available, 200)
    assert must[0] in result
    assert gpus_of(gpus, result) == {4, 5}  # 5's NVLink partner


def test_whole_gpu_must_include_on_partly_used_gpu_is_an_error() -> None:
    gpus = make_gpus(4)
    available = free_ids(gpus, [80, 100, 100, 100])
    must = [encode(gpus[0].uuid, 99)]
    with pytest.raises(AllocationError, match="not fully free"):
        preferred_allocation(gpus, PCIE, available, must, 100)


@pytest.mark.parametrize(
    ("free", "size"),
    [
        pytest.param([100, 99, 100, 0], 300, id="two-fully-free-need-three"),
        pytest.param([99, 99, 99, 99], 100, id="none-fully-free"),
        pytest.param([100, 100, 100, 100], 500, id="more-than-the-node-has"),
    ],
)
def test_not_enough_fully_free_gpus(free: list[int], size: int) -> None:
    gpus = make_gpus(4)
    with pytest.raises(InsufficientCapacityError, match=f"{size // 100} whole GPUs requested"):
        preferred_allocation(gpus, PCIE, free_ids(gpus, free), [], size)


@pytest.mark.parametrize("partial", range(8))
def test_partly_used_gpu_is_never_part_of_a_whole_gpu_answer(partial: int) -> None:
    gpus = make_gpus(8)
    free = [100] * 8
    free[partial] = 99
    available = free_ids(gpus, free)
    for size in (100, 200, 300, 400, 700):
        result = preferred_allocation(gpus, H100X8, available, [], size)
        check_valid(result, available, size)
        chosen = gpus_of(gpus, result)
        assert partial not in chosen
        assert len(chosen) == size // 100
        # Whole GPUs come with all 100 of their IDs.
        assert sorted(result) == sorted(i for g in chosen for i in ids_for_gpu(gpus[g].uuid))


@pytest.mark.parametrize("size", [100, 200, 300, 400])
def test_greedy_path_returns_a_valid_set(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(placement, "_MAX_COMBINATIONS", 1)
    gpus = make_gpus(8)
    available = free_ids(gpus, [100, 100, 70] + [100] * 5)
    result = preferred_allocation(gpus, H100X8, available, [], size)
    check_valid(result, available, size)
    chosen = gpus_of(gpus, result)
    assert len(chosen) == size // 100
    assert 2 not in chosen
    if size == 200:
        assert H100X8.link(*sorted(chosen)).nvlinks > 0


def test_greedy_path_keeps_must_include(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "_MAX_COMBINATIONS", 1)
    gpus = make_gpus(8)
    available = free_ids(gpus, [100] * 8)
    must = [encode(gpus[6].uuid, 10)]
    result = preferred_allocation(gpus, H100X8, available, must, 200)
    check_valid(result, available, 200)
    assert gpus_of(gpus, result) == {6, 7}
