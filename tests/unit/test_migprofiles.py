"""NVIDIA's MIG tables and placement rules (agent/platform/gpu/migprofiles.py) against the MIG
user guide: profile ids, sizes, instance counts, placements, what fits beside what, and the
nvidia-caps minors."""

from __future__ import annotations

import pytest

from agent.platform.gpu.migprofiles import (
    PRODUCTS,
    GpuInstanceProfile,
    MigProduct,
    Placement,
    choose_placement,
    ci_cap_minor,
    ci_profiles,
    free_placements,
    full_ci_profile,
    gi_cap_minor,
    gpu_instance_id,
    mig_minors,
    product,
    remaining_capacity,
)

# (id, compute slices, memory slices, instances, placement starts, placement size) of each
# product's profiles, in the order nvidia-smi mig -lgip / -lgipp print them; only the names
# differ between products.
SHAPES = [
    (19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    (20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    (15, 1, 2, 4, (0, 2, 4, 6), 2),
    (14, 2, 2, 3, (0, 2, 4), 2),
    (9, 3, 4, 2, (0, 4), 4),
    (5, 4, 4, 1, (0,), 4),
    (0, 7, 8, 1, (0,), 8),
]
NAMES = {
    "A100-40GB": ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}
TABLES = {
    key: [(name, *shape) for name, shape in zip(names, SHAPES, strict=True)] for key, names in NAMES.items()
}


def gpu(key: str) -> MigProduct:
    found = product(key)
    assert found is not None
    return found


def profile(gpu_: MigProduct, name: str) -> GpuInstanceProfile:
    found = gpu_.by_name(name)
    assert found is not None, name
    return found


@pytest.mark.parametrize("key", sorted(TABLES))
def test_profile_tables_are_nvidias(key: str) -> None:
    rows = [
        (p.name, p.id, p.slices, p.memory_slices, p.instance_count, tuple(x.start for x in p.placements))
        for p in gpu(key).profiles
    ]
    assert rows == [row[:6] for row in TABLES[key]]
    for p, row in zip(gpu(key).profiles, TABLES[key], strict=True):
        assert {x.size for x in p.placements} == {row[6]}
        assert p.media == p.name.endswith("+me")
        assert p.nvml_name == f"MIG {p.name}"


def test_memory_and_sms_of_the_products() -> None:
    h100 = gpu("H100-80GB")
    assert [(p.memory_mib, p.sm_count) for p in h100.profiles] == [
        (9984, 16), (9984, 16), (20096, 26), (20096, 32), (40448, 60), (40448, 64), (81152, 132),
    ]  # fmt: skip
    assert [p.sm_count for p in gpu("A100-40GB").profiles] == [14, 14, 14, 28, 42, 56, 98]
    assert profile(gpu("A100-40GB"), "7g.40gb").memory_mib == 40448
    assert profile(gpu("H200-141GB"), "1g.18gb").memory_mib == 16384
    assert h100.sm_count == 132 and gpu("A100-80GB").sm_count == 108
    # NVML's profile indexes: 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4, REV1 7, REV2 9
    assert [p.index for p in h100.profiles] == [0, 7, 9, 1, 2, 3, 4]


def test_lookups() -> None:
    assert product("h100-80gb") is gpu("H100-80GB")
    assert product("T4-16GB") is None and product("H100-94GB") is None
    h100 = gpu("H100-80GB")
    assert h100.by_id(9) == h100.by_name("MIG 3g.40gb") == h100.by_index(2)
    assert h100.by_id(99) is None and h100.by_name("5g.50gb") is None
    assert len(PRODUCTS) == 4


def fits(key: str, names: list[str]) -> bool:
    """Whether the GIs can all be created, in order, each where the driver would place it."""
    gpu_ = gpu(key)
    existing: list[tuple[GpuInstanceProfile, Placement]] = []
    for name in names:
        p = profile(gpu_, name)
        place = choose_placement(gpu_, p, existing)
        if place is None:
            return False
        existing.append((p, place))
    return True


def test_what_fits_on_an_h100() -> None:
    assert fits("H100-80GB", ["1g.10gb"] * 7)
    assert not fits("H100-80GB", ["1g.10gb"] * 8)  # seven compute slices
    assert not fits("H100-80GB", ["4g.40gb", "4g.40gb"])  # one 4g placement only
    assert fits("H100-80GB", ["4g.40gb", "3g.40gb"])
    assert fits("H100-80GB", ["3g.40gb", "3g.40gb"])
    assert not fits("H100-80GB", ["3g.40gb"] * 3)
    assert fits("H100-80GB", ["2g.20gb"] * 3 + ["1g.10gb"])
    assert not fits("H100-80GB", ["2g.20gb"] * 4)
    assert fits("H100-80GB", ["1g.20gb"] * 4)
    assert not fits("H100-80GB", ["1g.20gb"] * 4 + ["1g.10gb"])  # all 8 memory slices taken
    assert not fits("H100-80GB", ["1g.10gb+me", "1g.10gb+me"])  # one +me at most
    assert fits("H100-80GB", ["7g.80gb"]) and not fits("H100-80GB", ["7g.80gb", "1g.10gb"])


def test_the_user_guides_order_dependence() -> None:
    """The guide's 3-2-1-1 geometry: 3g first fits; after two 1g and a 2g it does not."""
    assert fits("A100-40GB", ["3g.20gb", "1g.5gb", "2g.10gb", "1g.5gb"])
    assert not fits("A100-40GB", ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"])


def test_default_placements_follow_the_user_guide() -> None:
    a100 = gpu("A100-40GB")
    existing: list[tuple[GpuInstanceProfile, Placement]] = []
    got = []
    for name in ["2g.10gb", "1g.5gb", "1g.5gb", "1g.5gb", "1g.5gb", "1g.5gb"]:
        p = profile(a100, name)
        place = choose_placement(a100, p, existing)
        assert place is not None
        existing.append((p, place))
        got.append(str(place))
    assert got == ["4:2", "6:1", "0:1", "1:1", "2:1", "3:1"]  # "Creation of a 2-1-1-1-1-1 geometry"
    assert choose_placement(a100, profile(a100, "3g.20gb"), []) == Placement(4, 4)


def test_placement_conflicts_and_remaining_capacity() -> None:
    h100 = gpu("H100-80GB")
    three, one, two = profile(h100, "3g.40gb"), profile(h100, "1g.10gb"), profile(h100, "2g.20gb")
    taken = [(three, Placement(0, 4))]
    assert free_placements(one, [Placement(0, 4)]) == [Placement(s, 1) for s in (4, 5, 6)]
    assert remaining_capacity(one, taken) == 3
    assert remaining_capacity(two, taken) == 1  # 4:2 only: 2g cannot start at 6
    assert remaining_capacity(three, taken) == 1
    assert remaining_capacity(profile(h100, "4g.40gb"), taken) == 0
    assert remaining_capacity(profile(h100, "7g.80gb"), []) == 1
    me = profile(h100, "1g.10gb+me")
    assert remaining_capacity(me, [(me, Placement(6, 1))]) == 0  # its instance count is 1
    assert Placement(0, 4).overlaps(Placement(3, 1)) and not Placement(0, 4).overlaps(Placement(4, 4))


def test_compute_instance_profiles() -> None:
    h100 = gpu("H100-80GB")
    seven = ci_profiles(profile(h100, "7g.80gb"), h100)
    assert [(c.index, c.name, c.instance_count, c.sm_count) for c in seven] == [
        (0, "1c.7g.80gb", 7, 16), (1, "2c.7g.80gb", 3, 32), (2, "3c.7g.80gb", 2, 60),
        (3, "4c.7g.80gb", 1, 64), (4, "7g.80gb", 1, 132),
    ]  # fmt: skip
    assert [str(p) for p in seven[2].placements] == ["0:3", "4:3"]
    three = ci_profiles(profile(h100, "3g.40gb"), h100)
    assert [(c.name, c.instance_count) for c in three] == [
        ("1c.3g.40gb", 3), ("2c.3g.40gb", 1), ("3g.40gb", 1),
    ]  # fmt: skip
    assert full_ci_profile(profile(h100, "2g.20gb"), h100).index == 1  # CI profile 2_SLICE
    assert [c.name for c in ci_profiles(profile(h100, "1g.10gb"), h100)] == ["1g.10gb"]


def test_gpu_instance_ids_follow_the_slot_tree() -> None:
    assert gpu_instance_id(Placement(0, 8), []) == 0
    assert gpu_instance_id(Placement(4, 4), []) == 1
    assert gpu_instance_id(Placement(0, 4), [1]) == 2
    assert gpu_instance_id(Placement(0, 4), [1, 2]) is None
    assert gpu_instance_id(Placement(4, 2), []) == 5
    assert [gpu_instance_id(Placement(s, 1), []) for s in range(7)] == list(range(7, 14))


def test_cap_minors_as_mig_minors_numbers_them() -> None:
    # The user guide: gpu0/gi1 with CIs 0..2 -> nvidia-cap12..15; the table ends with
    # gpu31/gi14/ci7/access 4322.
    assert [gi_cap_minor(0, 1), *(ci_cap_minor(0, 1, c) for c in range(3))] == [12, 13, 14, 15]
    assert gi_cap_minor(0, 0) == 3 and ci_cap_minor(0, 0, 0) == 4
    assert ci_cap_minor(31, 14, 7) == 4322
    lines = mig_minors([0]).splitlines()
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert lines[-1] == "gpu0/gi14/ci7/access 137"
    with pytest.raises(ValueError, match=r"GI ids are 0\.\.14"):
        gi_cap_minor(0, 15)
