"""The smallest MIG profile that covers a hardware-isolated share."""

from __future__ import annotations

import pytest

from agent.domain.migfit import covering_profiles, smallest_fit, why_not
from agent.platform.gpu.migprofiles import Placement, product

H100 = product("H100-80GB")
A100 = product("A100-40GB")
assert H100 is not None and A100 is not None


@pytest.mark.parametrize(
    ("cores", "memory_mib", "name"),
    [
        (10, 1000, "1g.10gb"),  # 16/132 = 12 % of the SMs
        (12, 9984, "1g.10gb"),
        (13, 1000, "1g.20gb"),  # 26 SMs = 19 %: the next by compute, one slice still
        (12, 12000, "1g.20gb"),  # memory decides
        (20, 1000, "2g.20gb"),  # 32 SMs = 24 %
        (25, 1000, "3g.40gb"),
        (46, 1000, "4g.40gb"),
        (49, 1000, "7g.80gb"),
        (100, 81152, "7g.80gb"),
    ],
)
def test_the_smallest_profile_that_covers_cores_and_memory(cores: int, memory_mib: int, name: str) -> None:
    assert H100 is not None
    fit = smallest_fit(H100, cores, memory_mib)
    assert fit is not None
    assert fit.profile.name == name


def test_media_profiles_are_never_chosen() -> None:
    assert H100 is not None
    assert all(not p.media for p in covering_profiles(H100, 1, 0))


def test_a_taken_placement_moves_to_the_next_profile_that_fits() -> None:
    assert H100 is not None
    four = H100.by_name("4g.40gb")
    three = H100.by_name("3g.40gb")
    assert four is not None and three is not None
    # 4g at 0:4 and 3g at 4:4 leave nothing: a 1g share has no room
    full = [(four, Placement(0, 4)), (three, Placement(4, 4))]
    assert smallest_fit(H100, 5, 100, full) is None
    assert "no room" in why_not(H100, 5, 100)
    # with only the 4g, the 1g share fits in the other half, off the 4g's slices
    fit = smallest_fit(H100, 5, 100, full[:1])
    assert fit is not None and fit.profile.name == "1g.10gb"
    assert not fit.placement.overlaps(Placement(0, 4))


def test_a_share_no_profile_covers_is_refused_with_the_rule() -> None:
    assert A100 is not None
    # the A100's 7g has 98 of its 108 SMs: 90 %; a 95-core share cannot be isolated
    assert smallest_fit(A100, 95, 1000) is None
    text = why_not(A100, 95, 1000)
    assert "7g.40gb" in text and "90%" in text and "smallest MIG profile" in text
    assert "vcuda-core > 0" in why_not(A100, 0, 0)
