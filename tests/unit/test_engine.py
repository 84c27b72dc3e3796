"""The simulated GPU engine in virtual time: queues, time-slicing, MPS, NVML's samples."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import OutOfMemory
from agent.platform.gpu.sim.perfmon import Sample
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program
from agent.platform.gpu.sim.schedule import water_fill
from agent.platform.gpu.sim.virtual import VirtualNode

MIB = 1 << 20
TOL = 1e-6


def make_engine(wall_offset_s: float = 0.0, **fields: Any) -> GpuEngine:
    """An engine at t=0 whose samples are visible at once unless a test asks otherwise."""
    base: dict[str, Any] = {"sample_period_s": 0.1, "sample_delay_s": 0.0, "sample_jitter_s": 0.0}
    return GpuEngine(EngineConfig.ideal(**(base | fields)), 0.0, wall_offset_s)


def ran(engine: GpuEngine, now: float) -> dict[int, float]:
    return {c.pid: c.ran_s for c in engine.truth(now)}


# Queued work and freezing ---------------------------------------------------------------------


def test_queued_work_drains_after_a_freeze_for_exactly_its_remaining_length() -> None:
    """burn with 10 ms kernels, queue of 100 (a blocked launch tops it up 6 at a time):
    frozen at t=1 with its queue nearly full, the GPU still runs exactly what was queued,
    then the context stays idle until it is thawed."""
    node = VirtualNode([EngineConfig.ideal(queue_depth=100)])
    stats = WorkloadStats()
    proc = node.spawn(0, pattern_program(PatternSpec("burn", kernel_ms=10), stats))
    node.freeze(proc, 1.0)
    engine = node.engines[0]
    [truth] = engine.truth(1.0)
    assert 100 - 100 // 16 <= truth.queued <= 100
    assert truth.pending_s == pytest.approx(truth.queued * 0.01, abs=TOL)
    assert proc.blocked is not None and proc.blocked.left >= 1  # frozen inside a blocked launch
    drained = 1.0 + truth.pending_s
    for t in (1.3, 1.5, drained - 0.01):
        node.run_until(t)
        assert ran(engine, t)[proc.pid] == pytest.approx(t, abs=TOL)  # still running, alone
    node.run_until(drained)
    [done] = engine.truth(drained)
    assert done.ran_s == pytest.approx(drained, abs=TOL)
    assert done.queued == 0 and done.pending_s == 0.0
    launches = stats.launches
    for t in (2.0, 2.5, 3.0):
        node.run_until(t)
        assert ran(engine, t)[proc.pid] == pytest.approx(drained, abs=TOL)  # flat while frozen
    assert stats.launches == launches
    node.thaw(proc, 3.0)
    node.run_until(3.5)
    assert ran(engine, 3.5)[proc.pid] == pytest.approx(drained + 0.5, abs=TOL)  # runs again at once
    assert proc.freezes == [(1.0, True), (3.0, False)]


def test_a_full_queue_takes_only_what_fits() -> None:
    engine = make_engine(queue_depth=10)
    ctx = engine.create_context(7, 70, 0.0)
    assert engine.submit(ctx, 6, 0.001, 0.0) == 6
    assert engine.submit(ctx, 6, 0.001, 0.0) == 4
    assert engine.submit(ctx, 1, 0.001, 0.0) == 0
    assert engine.room(ctx) == 0
    engine.advance(0.0035)  # three done, a fourth under way
    assert (ctx.queued, engine.room(ctx)) == (7, 3)
    assert ctx.pending == pytest.approx(0.0065, abs=TOL)


def test_a_context_keeps_its_peak_memory_and_a_gone_one_is_remembered_with_it() -> None:
    engine = make_engine()
    ctx = engine.create_context(5, 50, 0.0)
    engine.allocate(ctx, 512 * MIB)
    engine.allocate(ctx, 256 * MIB)
    engine.allocate(ctx, -512 * MIB)
    (truth,) = engine.truth(0.1)
    assert (truth.memory_bytes, truth.peak_memory_bytes) == (256 * MIB, 768 * MIB)
    engine.destroy_context(ctx, 0.2)
    assert list(engine.departed_peaks) == [(5, 50, 768 * MIB)]


def test_a_destroyed_context_drops_its_queue_but_keeps_its_sample() -> None:
    engine = make_engine()
    ctx = engine.create_context(5, 50, 0.0)
    engine.submit(ctx, 100, 0.01, 0.0)
    engine.allocate(ctx, 64 * MIB)
    engine.destroy_context(ctx, 0.04)
    assert engine.truth(0.3) == [] and engine.memory() == {}
    assert ctx.queued == 0 and ctx.ran == pytest.approx(0.04, abs=TOL)
    assert engine.samples(0, 0.3) == [Sample(5, 100_000, 40)]  # the period it ran in, then none


# Time-slicing ---------------------------------------------------------------------------------


def test_two_busy_contexts_share_by_timeslices() -> None:
    engine = make_engine(timeslice_s=0.002)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0)
    engine.submit(a, 100, 0.01, 0.0)
    engine.submit(b, 100, 0.01, 0.0)
    assert ran(engine, 0.003) == pytest.approx({1: 0.002, 2: 0.001}, abs=TOL)  # a's slice, then b's
    for t in (0.0071, 0.0333, 0.25, 0.6789):
        times = ran(engine, t)
        assert times[1] + times[2] == pytest.approx(t, abs=TOL)  # the GPU never idles
        assert abs(times[1] - times[2]) <= 0.002 + TOL  # at most one slice apart
    assert ran(engine, 1.0) == pytest.approx({1: 0.5, 2: 0.5}, abs=TOL)
    assert engine.busy_s == pytest.approx(1.0, abs=TOL)
    assert engine.work_s == pytest.approx(1.0, abs=TOL)


def test_long_kernels_are_preempted_and_resumed_in_alternating_slices() -> None:
    """Two 10 ms kernels, 2 ms slices: a runs 0-2, 4-6, ... 16-18 ms; b 2-4, ... 18-20 ms."""
    engine = make_engine(timeslice_s=0.002)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0)
    engine.submit(a, 1, 0.010, 0.0)
    engine.submit(b, 1, 0.010, 0.0)
    assert engine.when_completed({a.cid: 1, b.cid: 1}) == pytest.approx({a.cid: 0.018, b.cid: 0.020}, abs=TOL)
    assert ran(engine, 0.005) == pytest.approx({1: 0.003, 2: 0.002}, abs=TOL)
    assert ran(engine, 0.011) == pytest.approx({1: 0.006, 2: 0.005}, abs=TOL)
    engine.advance(0.018)
    assert (a.queued, b.queued) == (0, 1)
    assert b.ran == pytest.approx(0.008, abs=TOL)
    engine.advance(0.020)
    assert b.queued == 0
    assert engine.work_s == pytest.approx(0.020, abs=TOL)


def test_a_context_left_alone_runs_without_a_break() -> None:
    """a 10 ms, b 3 ms: a 0-2, b 2-4, a 4-6, b 6-7 (done), then a alone 7-13 ms."""
    engine = make_engine(timeslice_s=0.002)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0)
    engine.submit(a, 1, 0.010, 0.0)
    engine.submit(b, 1, 0.003, 0.0)
    assert engine.when_completed({a.cid: 1, b.cid: 1}) == pytest.approx({a.cid: 0.013, b.cid: 0.007}, abs=TOL)
    assert ran(engine, 0.010) == pytest.approx({1: 0.007, 2: 0.003}, abs=TOL)


# MPS ----------------------------------------------------------------------------------------


def test_mps_clients_run_at_their_shares() -> None:
    engine = make_engine(mps=True)
    a = engine.create_context(1, 10, 0.0, share=0.3)
    b = engine.create_context(2, 20, 0.0, share=0.5)
    engine.submit(a, 100, 0.01, 0.0)
    engine.submit(b, 100, 0.01, 0.0)
    assert ran(engine, 1.0) == pytest.approx({1: 0.3, 2: 0.5}, abs=TOL)
    assert engine.work_s == pytest.approx(0.8, abs=TOL)
    assert engine.busy_s == pytest.approx(1.0, abs=TOL)  # some client ran all the time
    assert engine.device_utilization(1.0) == 100
    last = [s for s in engine.samples(0, 1.0) if s.timestamp_us == 1_000_000]
    assert sorted(last, key=lambda s: s.pid) == [Sample(1, 1_000_000, 30), Sample(2, 1_000_000, 50)]


def test_an_mps_client_alone_is_held_to_its_share() -> None:
    engine = make_engine(mps=True)
    ctx = engine.create_context(1, 10, 0.0, share=0.3)
    engine.submit(ctx, 100, 0.01, 0.0)
    assert engine.when_completed({ctx.cid: 100}) == pytest.approx({ctx.cid: 1.0 / 0.3}, abs=TOL)
    assert ran(engine, 1.0) == pytest.approx({1: 0.3}, abs=TOL)


def test_mps_shares_over_the_whole_gpu_are_water_filled() -> None:
    """0.2 and 0.9: 0.2 and 0.8 while both run; once the first is done the second gets 0.9."""
    assert water_fill([0.3, 0.5]) == pytest.approx([0.3, 0.5])
    assert water_fill([0.6, 0.7]) == pytest.approx([0.5, 0.5])
    assert water_fill([0.9, 0.2]) == pytest.approx([0.8, 0.2])
    engine = make_engine(mps=True)
    a = engine.create_context(1, 10, 0.0, share=0.2)
    b = engine.create_context(2, 20, 0.0, share=0.9)
    engine.submit(a, 10, 0.01, 0.0)  # 0.1 s at 0.2: done at 0.5 s
    engine.submit(b, 100, 0.01, 0.0)  # 0.4 s by then, the other 0.6 s at 0.9
    assert engine.when_completed({a.cid: 10, b.cid: 100}) == pytest.approx(
        {a.cid: 0.5, b.cid: 0.5 + 0.6 / 0.9}, abs=TOL
    )
    assert ran(engine, 0.25) == pytest.approx({1: 0.05, 2: 0.2}, abs=TOL)
    assert ran(engine, 1.0) == pytest.approx({1: 0.1, 2: 0.85}, abs=TOL)


# NVML's view --------------------------------------------------------------------------------


def test_samples_only_for_contexts_that_ran_in_the_period() -> None:
    """a runs 50 ms in period 0, b 30 ms in period 1; period 2 is idle: two samples in all,
    stamped at their periods' ends in wall µs, visible 0.25 s after those ends."""
    engine = make_engine(wall_offset_s=1000.0, sample_delay_s=0.25)
    a = engine.create_context(11, 1, 0.0)
    engine.submit(a, 5, 0.01, 0.0)
    b = engine.create_context(22, 2, 0.15)
    engine.submit(b, 3, 0.01, 0.15)
    first, second = Sample(11, 1_000_100_000, 50), Sample(22, 1_000_200_000, 30)
    assert engine.samples(0, 0.349) == []
    assert engine.samples(0, 0.35) == [first]
    assert engine.samples(0, 0.449) == [first]
    assert engine.samples(0, 0.45) == [first, second]
    assert engine.samples(0, 5.0) == [first, second]
    assert engine.samples(first.timestamp_us, 5.0) == [second]  # "since" is exclusive


def test_sample_util_is_the_rounded_percent_of_the_period() -> None:
    engine = make_engine()
    ctx = engine.create_context(3, 30, 0.0)
    engine.submit(ctx, 1, 0.0333, 0.0)  # 33.3 % of period 0
    engine.submit(ctx, 1, 0.1 + 0.0666, 0.1)  # period 1 whole, then 66.6 % of period 2
    assert [s.sm_util for s in engine.samples(0, 1.0)] == [33, 100, 67]
    assert [s.timestamp_us for s in engine.samples(0, 1.0)] == [100_000, 200_000, 300_000]


def test_samples_arrive_late_by_the_delay_plus_bounded_jitter_in_order() -> None:
    engine = make_engine(sample_delay_s=0.25, sample_jitter_s=0.25, seed=3)
    ctx = engine.create_context(9, 90, 0.0)
    engine.submit(ctx, 100, 0.02, 0.0)  # busy for 20 periods
    first_seen: dict[int, float] = {}
    for step in range(1, 3001):
        now = step / 1000
        for sample in engine.samples(0, now):
            first_seen.setdefault(sample.timestamp_us, now)
    assert sorted(first_seen) == [100_000 * k for k in range(1, 21)]
    lateness = [first_seen[ts] - ts / 1e6 for ts in sorted(first_seen)]
    assert all(0.25 - TOL <= late <= 0.5 + 0.001 + TOL for late in lateness), lateness
    assert max(lateness) - min(lateness) > 0.1  # the jitter is there
    seen = [first_seen[ts] for ts in sorted(first_seen)]
    assert seen == sorted(seen)  # never visible before an earlier one


def test_device_utilization_is_the_last_finished_period() -> None:
    engine = make_engine()
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 1, 0.05, 0.0)
    assert engine.device_utilization(0.05) == 0  # period 0 not finished yet
    assert engine.device_utilization(0.1) == 50
    assert engine.device_utilization(0.19) == 50
    assert engine.device_utilization(0.2) == 0  # period 1 was idle
    other = engine.create_context(2, 20, 0.2)
    engine.submit(ctx, 1, 0.03, 0.2)
    engine.submit(other, 1, 0.04, 0.2)
    assert engine.device_utilization(0.3) == 70  # busy while either ran
    assert engine.device_utilization(0.75) == 0


# Memory, configuration, predictions -----------------------------------------------------------


def test_allocation_over_the_gpu_memory_is_refused() -> None:
    engine = make_engine(memory_bytes=1024 * MIB)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0)
    engine.allocate(a, 600 * MIB)
    with pytest.raises(OutOfMemory, match=r"GPU 0: 500 MiB asked, 424 MiB free"):
        engine.allocate(b, 500 * MIB)
    assert engine.memory() == {1: 600 * MIB}
    engine.allocate(b, 424 * MIB)  # exactly what is left
    engine.allocate(a, -100 * MIB)
    assert engine.memory() == {1: 500 * MIB, 2: 424 * MIB}
    engine.destroy_context(a, 0.0)
    engine.allocate(b, 600 * MIB)
    assert engine.memory() == {2: 1024 * MIB}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("memory_bytes", 0, "GPU memory must be > 0, got 0"),
        ("timeslice_s", 0.00005, "timeslice must be 0.1..1000 ms, got 0.05 ms"),
        ("timeslice_s", 2.0, "timeslice must be 0.1..1000 ms, got 2000 ms"),
        ("sample_period_s", 0.005, "sample period must be 0.01..1 s, got 0.005 s"),
        ("sample_period_s", 1.5, "sample period must be 0.01..1 s, got 1.5 s"),
        ("sample_delay_s", -1.0, "sample delay must be 0..30 s, got -1 s"),
        ("sample_jitter_s", 31.0, "sample jitter must be 0..30 s, got 31 s"),
        ("queue_depth", 0, "queue depth must be 1..1000000 launches, got 0"),
    ],
)
def test_config_problems_name_the_bad_field(field: str, value: Any, named: str) -> None:
    config = dataclasses.replace(EngineConfig(), **{field: value})
    assert config.problems() == [named]
    with pytest.raises(InvalidSpecError, match=named.split(",", maxsplit=1)[0]):
        GpuEngine(config, 0.0, 0.0)


def test_config_problems_are_all_listed_and_the_defaults_are_valid() -> None:
    assert EngineConfig().problems() == []
    bad = EngineConfig(
        memory_bytes=-1,
        timeslice_s=0,
        sample_period_s=0,
        sample_delay_s=-1,
        sample_jitter_s=-1,
        queue_depth=0,
    )
    assert len(bad.problems()) == 6


@pytest.mark.parametrize("mps", [False, True], ids=["timesliced", "mps"])
def test_predicted_completions_are_where_advance_finishes_the_work(mps: bool) -> None:
    engine = make_engine(mps=mps, timeslice_s=0.002)
    plans = [(1, 0.4, 40, 0.0031, 25), (2, 0.7, 12, 0.0072, 12), (3, 0.5, 90, 0.0004, 60)]
    contexts, wants = [], {}
    for pid, share, count, each, want in plans:
        ctx = engine.create_context(pid, pid, 0.0, share=share)
        engine.submit(ctx, count, each, 0.0)
        contexts.append((ctx, count, want))
        wants[ctx.cid] = want
    predicted = engine.when_completed(wants)
    assert sorted(predicted) == sorted(wants)
    for ctx, count, want in sorted(contexts, key=lambda c: predicted[c[0].cid]):
        at = predicted[ctx.cid]
        engine.advance(at - 1e-6)
        assert ctx.queued > count - want, (ctx.pid, at)
        engine.advance(at)
        assert ctx.queued == count - want, (ctx.pid, at)


def test_a_lost_gpu_predicts_nothing_and_loses_its_contexts() -> None:
    engine = make_engine()
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 10, 0.01, 0.0)
    assert engine.set_lost(True, 0.05) == [ctx]
    assert engine.when_completed({ctx.cid: 10}) == {}
    assert engine.truth(1.0) == []
    assert ctx.ran == pytest.approx(0.05, abs=TOL)
