"""The duty-cycle control law in isolation: one container, hand-made measurements."""

from __future__ import annotations

import pytest

from agent.domain.dutycontrol import DutyState, Gains, Measurement, next_duty

GAINS = Gains()


def seen(used: float, start: float, end: float, *, cycles: int = 4) -> Measurement:
    return Measurement(used, start, end, now_s=end + 0.5, cycles=cycles)


def throttled(duty: float = 0.3) -> DutyState:
    state = DutyState(duty=duty, updated_s=0.0, cycles=4, cycle_set_s=0.0)
    next_duty(state, seen(30.0, 1.0, 2.0), 30.0, GAINS)  # on target: settled
    assert state.duty == pytest.approx(duty)
    return state


def test_far_over_its_target_a_container_jumps_there_at_once() -> None:
    state = DutyState()
    assert next_duty(state, seen(100.0, 0.0, 1.0), 30.0, GAINS) == pytest.approx(0.3)
    assert state.cycles == GAINS.start_cycles  # newly throttled: a cycle of one window


def test_a_measurement_from_before_the_last_change_is_not_acted_on() -> None:
    state = DutyState()
    next_duty(state, seen(100.0, 0.0, 1.0), 30.0, GAINS)
    # Its stretch began before the change (now_s 1.5): it still shows the old duty.
    assert next_duty(state, seen(90.0, 1.0, 2.0), 30.0, GAINS) == pytest.approx(0.3)
    # And a measurement no newer than the last one changes nothing either.
    assert next_duty(state, seen(90.0, 1.0, 2.0), 30.0, GAINS) == pytest.approx(0.3)


def test_a_large_raise_waits_for_a_second_measurement() -> None:
    state = throttled(0.3)
    first = next_duty(state, seen(10.0, 3.0, 4.0), 30.0, GAINS)
    assert first == pytest.approx(0.3 * 1.1 + 0.02)  # bounded: it may have caught a pause
    second = next_duty(state, seen(first * 100 / 3, 5.0, 6.0), 30.0, GAINS)
    assert second > first * 1.1 + 0.02  # asked again: all of it


def test_an_idle_container_keeps_its_duty_for_the_hold_then_is_released() -> None:
    state = throttled(0.3)
    assert next_duty(state, seen(0.0, 3.0, 4.0), 30.0, GAINS) == pytest.approx(0.3)
    assert next_duty(state, seen(0.0, 4.0, 6.0), 30.0, GAINS) == pytest.approx(0.3)
    late = Measurement(0.0, 8.0, 9.0, now_s=4.5 + GAINS.idle_hold_s)
    assert next_duty(state, late, 30.0, GAINS) == 1.0


def test_burst_share_neighbours_pausing_together_come_back_held() -> None:
    """Idle, its target becomes the whole GPU (the neighbour is idle too): it keeps its
    duty; back, it is measured over a stretch that still holds its pause while the late
    samples may not show the neighbour back yet: still held; a stretch wholly after the
    pause that shows it alone releases it."""
    state = throttled(0.3)
    assert next_duty(state, seen(0.0, 3.0, 4.0), 100.0, GAINS) == pytest.approx(0.3)
    assert next_duty(state, None, 100.0, GAINS) == pytest.approx(0.3)
    assert next_duty(state, seen(60.0, 3.5, 4.5), 100.0, GAINS) == pytest.approx(0.3)
    assert next_duty(state, seen(30.0, 5.0, 6.0), 100.0, GAINS) == 1.0


def test_a_container_alone_with_the_whole_gpu_is_released_at_once() -> None:
    state = throttled(0.3)  # its neighbour left: nothing to hold it to
    assert next_duty(state, seen(30.0, 3.0, 4.0), 100.0, GAINS) == 1.0


def test_the_cycle_doubles_when_the_use_does_not_follow_the_duty() -> None:
    """Units of work that drain after every freeze: 40 % whatever the duty."""
    state = DutyState()
    next_duty(state, seen(100.0, 0.0, 1.0), 30.0, GAINS)
    t = 2.0
    for _ in range(20):
        next_duty(state, seen(40.0, t, t + 1.0, cycles=state.cycles), 30.0, GAINS)
        t += 2.0
        if state.cycles > GAINS.start_cycles:
            break
    assert state.cycles == 2 * GAINS.start_cycles
    assert state.drain_s is not None and state.drain_s > 0


def test_a_whole_gpu_target_never_throttles() -> None:
    state = DutyState()
    assert next_duty(state, seen(100.0, 0.0, 1.0), None, GAINS) == 1.0
    assert next_duty(state, seen(100.0, 1.0, 2.0), 100.0, GAINS) == 1.0
