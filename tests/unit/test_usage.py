"""The utilization estimator: NVML's late, bursty, gappy per-process samples."""

from __future__ import annotations

import pytest

from agent.domain.usage import GpuUsageEstimator

S = 1_000_000  # µs per second


def ticks(
    start_s: float, count: int, step_s: float, key: str | None, util: float
) -> list[tuple[str | None, int, float]]:
    return [(key, int((start_s + i * step_s) * S), util) for i in range(count)]


def test_a_steady_process_reads_its_utilization() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 20, 0.2, "a", 40))
    assert est.estimate(104.0).by_key["a"] == pytest.approx(40)


def test_missing_samples_count_as_idle_time() -> None:
    # The driver reports only active processes: "b" is active every other tick.
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=2.0)
    est.add_samples(ticks(100, 20, 0.2, "a", 30))
    est.add_samples(ticks(100, 10, 0.4, "b", 80))
    shares = est.estimate(104.0).by_key
    assert shares["a"] == pytest.approx(30)
    assert shares["b"] == pytest.approx(40, abs=1)


def test_late_samples_land_in_their_own_ticks_and_do_not_read_as_idleness() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0, stale_after_s=5.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 50))
    # Three seconds later a burst arrives: the samples of the seconds in between.
    estimate = est.estimate(104.9)
    assert estimate.by_key["a"] == pytest.approx(50)
    assert estimate.newest_sample_age_s == pytest.approx(3.1)
    est.add_samples(list(reversed(ticks(102, 10, 0.2, "a", 70))))  # out of order, too
    assert est.estimate(105.0).by_key["a"] == pytest.approx(70)


def test_processes_outside_containers_are_not_anyones_use() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0)
    est.add_samples(ticks(100, 10, 0.2, None, 60) + ticks(100, 10, 0.2, "a", 20))
    assert est.estimate(102.0).by_key == {"a": pytest.approx(20)}


def test_stale_samples_fall_back_to_device_utilization_split_by_the_last_shares() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator(window_s=1.0, stale_after_s=2.0)
    est.add_samples(ticks(100, 10, 0.2, "a", 30) + ticks(100, 10, 0.2, "b", 10))
    assert est.estimate(102.0).source == "samples"
    for t in (109.2, 109.5, 109.9):
        est.add_device(t, 80)
    estimate = est.estimate(110.0)
    assert estimate.source == "device-shares"
    assert estimate.by_key["a"] == pytest.approx(60)
    assert estimate.by_key["b"] == pytest.approx(20)


def test_nothing_yet() -> None:
    est: GpuUsageEstimator[str] = GpuUsageEstimator()
    assert est.estimate(1.0).source == "none"
