"""The utilization estimator: NVML's late, bursty, gappy per-process samples."""

from __future__ import annotations

import pytest

from agent.domain.usage import GpuUsageEstimator

S = 1_000_000  # µs per second
Row = tuple[str | None, int, int, float]


def ticks(
    start_s: float, count: int, step_s: float, key: str | None, util: float, *, pid: int = 1
) -> list[Row]:
    return [(key, pid, int((start_s + i * step_s) * S), util) for i in range(count)]


def test_a_steady_process_reads_its_utilization() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 20, 0.2, "a", 40))
    assert est.estimate(104.0).by_key["a"] == pytest.approx(40)


def test_the_period_is_learned_from_the_smallest_gap_of_one_process() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator()
    est.add_samples(ticks(100, 5, 0.4, "a", 10, pid=1) + ticks(100, 9, 0.2, "b", 10, pid=2))
    assert est.period_us() == 200_000
    est.sample_period_s = 1 / 6  # the backend knows better
    assert est.period_us() == 166_666


def test_missing_samples_count_as_idle_time() -> None:
    # The driver reports only processes that ran: "b" ran in every other period.
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=2.0)
    est.add_samples(ticks(100, 20, 0.2, "a", 30, pid=1))
    est.add_samples(ticks(100, 10, 0.4, "b", 80, pid=2))
    shares = est.estimate(104.0).by_key
    assert shares["a"] == pytest.approx(30)
    assert shares["b"] == pytest.approx(40, abs=1)


def test_a_sample_covers_the_period_before_its_stamp() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.sample_period_s = 0.5
    est.add_samples([("a", 1, 101 * S, 60.0), ("a", 1, int(101.5 * S), 20.0)])
    # (100.5, 101] at 60 %, (101, 101.5] at 20 %: a quarter-period slice of each.
    assert est.usage_between(100.75, 101.25)["a"] == pytest.approx(40)
    assert est.usage_between(100.5, 101.0)["a"] == pytest.approx(60)
    # Time no sample covers (before the first period) is left out, not read as idle.
    assert est.usage_between(99.0, 101.0)["a"] == pytest.approx(60)


def test_late_samples_land_in_their_own_periods_and_do_not_read_as_idleness() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0, stale_after_s=5.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 50))
    # Three seconds later a burst arrives: the samples of the seconds in between.
    estimate = est.estimate(104.9)
    assert estimate.by_key["a"] == pytest.approx(50)
    assert estimate.newest_sample_age_s == pytest.approx(3.1)
    est.add_samples(list(reversed(ticks(102, 10, 0.2, "a", 70))))  # out of order, too
    assert est.estimate(105.0).by_key["a"] == pytest.approx(70)


def test_a_sample_read_twice_counts_once() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    rows = ticks(100, 10, 0.2, "a", 50)
    est.add_samples(rows)
    est.add_samples(rows[-5:])  # a since-timestamp that overlapped
    assert est.estimate(102.0).by_key["a"] == pytest.approx(50)


def test_processes_of_one_container_add_up() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 20, pid=1) + ticks(100, 10, 0.2, "a", 15, pid=2))
    assert est.estimate(102.0).by_key["a"] == pytest.approx(35)


def test_processes_outside_containers_are_not_anyones_use() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 10, 0.2, None, 60, pid=7) + ticks(100, 10, 0.2, "a", 20))
    assert est.estimate(102.0).by_key == {"a": pytest.approx(20)}


def test_an_idle_device_zeroes_every_container_at_once() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 70))
    assert est.estimate(102.0).by_key["a"] == pytest.approx(70)
    for t in (102.2, 102.6, 103.0):
        est.add_device(t, 0)
    estimate = est.estimate(103.0)
    assert estimate.source == "device-idle"
    assert estimate.by_key == {"a": 0.0}


def test_stale_samples_fall_back_to_device_utilization_split_by_the_last_shares() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0, stale_after_s=2.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 30, pid=1) + ticks(100, 10, 0.2, "b", 10, pid=2))
    assert est.estimate(102.0).source == "samples"
    for t in (109.2, 109.5, 109.9):
        est.add_device(t, 80)
    estimate = est.estimate(110.0)
    assert estimate.source == "device-shares"
    assert estimate.by_key["a"] == pytest.approx(60)
    assert estimate.by_key["b"] == pytest.approx(20)


def test_old_samples_are_dropped() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0, keep_s=2.0, max_period_s=1.0)
    est.add_samples(ticks(100, 100, 0.2, "a", 30))
    assert est.usage_between(100.0, 110.0) == {}
    assert est.usage_between(118.0, 119.8)["a"] == pytest.approx(30)


def test_nothing_yet() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator()
    assert est.estimate(1.0).source == "none"
