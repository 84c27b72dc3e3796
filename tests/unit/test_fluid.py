"""Attribution of device samples through the agent's own freeze record (agent.domain.fluid):
exact figures for thaws, turns, drains, truncated drains, rates and idleness."""

from __future__ import annotations

import pytest

from agent.domain.fluid import Attribution, Demand, water_fill


def test_water_fill_divides_the_gpu_max_min_fairly() -> None:
    assert water_fill({"a": 0.2, "b": 1.0, "c": 1.0}) == pytest.approx({"a": 0.2, "b": 0.4, "c": 0.4})
    assert water_fill({"a": 0.3}) == {"a": 0.3}
    assert water_fill({}) == {}


def test_a_container_thawed_alone_takes_the_busy_time_and_its_rate_follows() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    assert record.take(0.2, 0.2, 80) == pytest.approx({"a": 0.16})
    assert record.models["a"].rate == pytest.approx(0.95)  # 1 + 0.25 x (0.8 - 1)
    assert record.take(0.2, 0.2, 80) == {}  # a period already accounted for


def test_turns_split_a_sample_by_who_was_thawed_when() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.record(0.1, "a", False, drain=0.0)
    record.record(0.1, "b", True)
    got = record.take(0.2, 0.2, 100)
    # a is expected to drain one short kernel (2 ms) beside b: the rest is b's.
    assert got == pytest.approx({"a": 0.102, "b": 0.098}, abs=1e-6)


def test_a_drain_seen_alone_is_measured_and_sets_the_wait_after_the_next_freeze() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.record(0.1, "a", False, drain=0.03)
    # 0.1 s thawed, then 0.05 s of queued work ran on: busy 75 % of 0.2 s.
    assert record.take(0.2, 0.2, 75) == pytest.approx({"a": 0.15})
    assert record.take(0.4, 0.2, 0) == {}  # the GPU went quiet: the drain is over
    model = record.models["a"]
    assert list(model.drains) == pytest.approx([0.05])
    assert model.drain_s == pytest.approx(0.05)
    assert model.wait_s == pytest.approx(1.02 * 0.05 + 0.005)
    assert record.drain_seen["a"] == pytest.approx(0.4)


def test_a_drain_that_filled_its_wait_is_not_measured_and_the_wait_grows() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.record(0.1, "a", False, drain=0.01)
    record.record(0.12, "b", True)  # 20 ms after the freeze: a's drain was still running
    record.take(0.2, 0.2, 100)
    model = record.models["a"]
    assert list(model.drains) == []
    assert model.wait_s == pytest.approx(1.5 * 0.02)
    assert model.runs_on_s == pytest.approx(0.02)  # at least this much runs on


def test_a_wait_that_grew_comes_down_slowly() -> None:
    model = Demand(wait_s=0.1)
    model.observe_drain(0.01)
    assert model.wait_s == pytest.approx(0.09)  # 0.9 x 0.1, not 1.02 x 0.01 + 0.005 at once
    for _ in range(40):
        model.observe_drain(0.01)
    assert model.wait_s == pytest.approx(1.02 * 0.01 + 0.005)


def test_with_no_drain_expected_the_thawed_containers_take_all_the_busy_time() -> None:
    record = Attribution[str](0.0)
    record.models["a"] = Demand(rate=0.5)  # learned while it had gaps
    record.record(0.0, "a", True)
    assert record.take(0.2, 0.2, 90) == pytest.approx({"a": 0.18})


def test_a_container_thawed_with_nothing_to_run_is_idle_until_its_work_shows() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.take(0.2, 0.2, 0)
    assert record.models["a"].idle
    assert record.models["a"].rate == 1.0  # an idle stretch says nothing about its rate
    record.take(0.4, 0.2, 90)
    assert not record.models["a"].idle


def test_project_adds_what_the_record_says_and_no_sample_shows_yet() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.take(0.2, 0.2, 100)
    record.record(0.3, "a", False, drain=0.02)
    record.record(0.3, "b", True)
    assert record.project(0.5) == pytest.approx({"a": 0.1 + 0.02, "b": 0.2})
    assert record.draining() == {}  # nothing frozen yet as far as the samples go


def test_forget_drops_a_container_everywhere() -> None:
    record = Attribution[str](0.0)
    record.record(0.0, "a", True)
    record.record(0.1, "a", False)
    record.forget("a")
    assert list(record.known()) == []
    assert record.take(0.2, 0.2, 50) == {}
