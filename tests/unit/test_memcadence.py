"""The memory guard's check cadence in virtual time: a container near its
quota and growing, or heading for it, is checked at the short period; others at the base."""

from __future__ import annotations

import math

import pytest

from agent.domain.memcadence import CadenceSettings, CheckCadence, Usage
from agent.domain.memquota import MIB

QUOTA = 1024 * MIB
NEAR = CadenceSettings().near_s


def grower(step_mib: int, every_s: float, start_s: float, near_s: float = 0.01) -> tuple[float, bool]:
    """Run the cadence against a container that held nothing for a second, then holds
    ``step_mib`` more every ``every_s`` from ``start_s`` (a check at time t sees the steps made
    up to t), until a check sees it over the quota. Returns (what that check saw, in percent
    over, whether an earlier check saw it climbing: holding memory, not over)."""
    cadence = CheckCadence(CadenceSettings(near_s=near_s))
    now, climbing = -1.0, False
    while True:
        steps = 0 if now < start_s else math.floor((now - start_s) / every_s + 1e-9) + 1
        used = steps * step_mib * MIB
        if used > QUOTA:
            return 100 * (used - QUOTA) / QUOTA, climbing
        climbing = climbing or used > 0
        now += cadence.after_check(now, {"ns/p/c": Usage(used, QUOTA)})


PHASES = (0.0, 0.003, 0.011, 0.017, 0.1, 0.199)  # the growth's start against the base checks


@pytest.mark.parametrize(
    ("step_mib", "every_s"),
    [
        (64, 0.02),  # the reference rate: 1024 MiB in 0.32 s, more than one base period
        (8, 0.02),
        (64, 0.5),  # slow
        (256, 0.02),  # 1024 MiB in 0.08 s: caught in time only if a base check lands in the climb
    ],
)
def test_a_container_seen_climbing_is_caught_within_one_step_of_its_quota(
    step_mib: int, every_s: float
) -> None:
    bound_pct = 100 * step_mib / 1024
    caught = 0
    for start_s in PHASES:
        over_pct, climbing = grower(step_mib, every_s, start_s)
        assert over_pct > 0
        if climbing:
            assert over_pct <= bound_pct + 1e-9, (start_s, over_pct)
            caught += 1
    assert caught >= (1 if step_mib == 256 else len(PHASES))


def test_at_the_base_period_alone_the_issue_rate_ends_far_over() -> None:
    """The old loop (near_s 0): 64 MiB every 20 ms is 640 MiB per 0.2 s period."""
    worst = max(grower(64, 0.02, start_s, near_s=0.0)[0] for start_s in PHASES)
    assert worst > 40


def test_a_still_container_near_its_quota_keeps_the_base_period() -> None:
    cadence = CheckCadence(CadenceSettings())
    now = 0.0
    delays = []
    while now < 3.0:
        delays.append(cadence.after_check(now, {"k": Usage(1000 * MIB, QUOTA)}))
        now += delays[-1]
    # Seen first at 1000 MiB (new: its rate is unknown): fast for the hold, then base.
    assert delays[0] == NEAR
    assert all(d == 0.2 for d in delays[-5:])
    assert cadence.fast() == []


def test_growth_far_below_the_quota_at_a_slow_rate_keeps_the_base_period() -> None:
    cadence = CheckCadence(CadenceSettings())
    cadence.after_check(-2.0, {"k": Usage(100 * MIB, QUOTA)})  # new: fast for its hold
    assert cadence.after_check(0.0, {"k": Usage(100 * MIB, QUOTA)}) == 0.2
    # 10 MiB per 0.2 s at 110 MiB: 4 periods ahead is 150 MiB.
    assert cadence.after_check(0.2, {"k": Usage(110 * MIB, QUOTA)}) == 0.2


def test_heading_for_the_quota_at_its_rate_is_near_before_the_level_is() -> None:
    cadence = CheckCadence(CadenceSettings())
    cadence.after_check(-2.0, {"k": Usage(100 * MIB, QUOTA)})
    assert cadence.after_check(0.0, {"k": Usage(100 * MIB, QUOTA)}) == 0.2
    # 200 MiB in 0.2 s: at 300 MiB (29 % of the quota) it would be over within 0.8 s.
    assert cadence.after_check(0.2, {"k": Usage(300 * MIB, QUOTA)}) == NEAR
    assert cadence.fast() == ["k"]


def test_the_short_period_lasts_its_hold_after_the_last_growth_then_ends() -> None:
    cadence = CheckCadence(CadenceSettings(hold_s=0.1))
    cadence.after_check(0.0, {"k": Usage(700 * MIB, QUOTA)})
    assert cadence.after_check(0.2, {"k": Usage(800 * MIB, QUOTA)}) == NEAR
    assert cadence.after_check(0.25, {"k": Usage(800 * MIB, QUOTA)}) == NEAR  # still within its hold
    assert cadence.after_check(0.31, {"k": Usage(800 * MIB, QUOTA)}) == 0.2


def test_shrinking_over_quota_or_no_quota_is_not_near_and_gone_containers_are_forgotten() -> None:
    cadence = CheckCadence(CadenceSettings())
    cadence.after_check(0.0, {"a": Usage(900 * MIB, QUOTA), "b": Usage(900 * MIB, QUOTA)})
    cadence.after_check(2.0, {"a": Usage(900 * MIB, QUOTA), "b": Usage(900 * MIB, QUOTA)})
    assert cadence.fast() == []
    assert cadence.after_check(2.2, {"a": Usage(800 * MIB, QUOTA), "b": Usage(2000 * MIB, QUOTA)}) == 0.2
    assert cadence.after_check(2.4, {"c": Usage(10 * MIB, 0)}) == 0.2
    # "a" was forgotten: seen again, it is new, and 900 MiB is near.
    assert cadence.after_check(2.6, {"a": Usage(900 * MIB, QUOTA)}) == NEAR


def test_near_s_zero_or_not_shorter_than_the_base_keeps_the_old_fixed_period() -> None:
    for near_s in (0.0, 0.2, 0.5):
        cadence = CheckCadence(CadenceSettings(near_s=near_s))
        assert not cadence.settings.adaptive
        cadence.after_check(0.0, {"k": Usage(0, QUOTA)})
        assert cadence.after_check(0.2, {"k": Usage(1000 * MIB, QUOTA)}) == 0.2


def test_a_partial_check_does_not_forget_the_containers_it_did_not_cover() -> None:
    cadence = CheckCadence(CadenceSettings())
    cadence.after_check(0.0, {"still": Usage(500 * MIB, QUOTA), "near": Usage(700 * MIB, QUOTA)})
    cadence.after_check(2.0, {"still": Usage(500 * MIB, QUOTA), "near": Usage(700 * MIB, QUOTA)})
    assert (
        cadence.after_check(2.2, {"still": Usage(500 * MIB, QUOTA), "near": Usage(800 * MIB, QUOTA)}) == NEAR
    )
    assert cadence.after_check(2.21, {"near": Usage(810 * MIB, QUOTA)}, partial=True) == NEAR
    # "still" is remembered at 500 MiB: the next full check sees no growth, not a new container.
    assert (
        cadence.after_check(2.4, {"still": Usage(500 * MIB, QUOTA), "near": Usage(810 * MIB, QUOTA)}) == NEAR
    )
    assert cadence.fast() == ["near"]
