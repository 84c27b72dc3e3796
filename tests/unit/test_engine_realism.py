"""The simulated GPU's driver-like behaviours in virtual time: context-switch cost, host
wake-ups after a sync, the driver's sample ring (one sample per period, crediting the process
executing at its end, with its SM activity), device samples, the NVML library's aggregation
per call, MPS attribution, and the configuration of all of it.

Every figure is derived from the model: the schedule (timeslice + switch per turn), the
credited SM activity (``sm_activity`` x GPU time over the credit window) and the rounding to a
whole percent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.inventory import DeviceSample
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.nvmllib import process_utilization
from agent.platform.gpu.sim.perfmon import NO_PROCESS, Sample
from agent.platform.gpu.sim.programs import (
    Launch,
    PatternSpec,
    Program,
    Sync,
    WorkloadStats,
    pattern_program,
)
from agent.platform.gpu.sim.virtual import VirtualNode

PERIOD = 0.1
PERIOD_US = 100_000
TOL = 1e-9
SM = 0.867  # EngineConfig's default SM activity
SERVER = 900


def config(**fields: Any) -> EngineConfig:
    """The realistic defaults, with 100 ms periods and samples visible at once unless asked."""
    base: dict[str, Any] = {"sample_period_s": PERIOD, "sample_delay_s": 0.0, "sample_jitter_s": 0.0}
    return EngineConfig(**(base | fields))


def make_engine(**fields: Any) -> GpuEngine:
    return GpuEngine(config(**fields), 0.0, 0.0)


def ran(engine: GpuEngine, now: float) -> dict[int, float]:
    return {c.pid: c.ran_s for c in engine.truth(now)}


def stamp(k: int) -> int:
    """The wall timestamp of the end of period ``k`` (1-based) on an engine started at 0."""
    return k * PERIOD_US


def two_busy(engine: GpuEngine, seconds_each: float = 3.0) -> None:
    """Two contexts (pids 1 and 2) with far more queued than the test runs."""
    for pid in (1, 2):
        ctx = engine.create_context(pid, pid * 10, 0.0)
        engine.submit(ctx, round(seconds_each / 0.01), 0.01, 0.0)


# Context switches -------------------------------------------------------------------------------


def test_two_busy_contexts_pay_a_switch_before_every_turn() -> None:
    """2 ms slices, 0.25 ms switches: a round is [switch, a 2 ms, switch, b 2 ms] = 4.5 ms.
    In 1 s: 222 whole rounds (0.999 s), then a switch and 0.75 ms of a: each context runs
    timeslice/(timeslice+switch) of its half, 0.4444 s, the engine is busy all the time and
    0.111 s of it moves nobody's work."""
    engine = make_engine(timeslice_s=0.002, switch_s=0.00025)
    two_busy(engine)
    assert ran(engine, 0.0001) == {1: 0.0, 2: 0.0}  # loading a: busy, nothing runs
    assert engine.busy_s == pytest.approx(0.0001, abs=TOL)
    assert ran(engine, 0.0024) == pytest.approx({1: 0.002, 2: 0.0}, abs=TOL)  # inside the switch to b
    assert ran(engine, 0.0030) == pytest.approx({1: 0.002, 2: 0.0005}, abs=TOL)
    times = ran(engine, 1.0)
    assert times == pytest.approx({1: 222 * 0.002 + 0.00075, 2: 222 * 0.002}, abs=TOL)
    for pid in (1, 2):
        assert times[pid] == pytest.approx(0.5 * 0.002 / 0.00225, abs=0.002)  # 0.4444, within a slice
    assert engine.busy_s == pytest.approx(1.0, abs=TOL)
    assert engine.work_s == pytest.approx(0.88875, abs=TOL)
    assert [s.util for s in engine.device_samples(0, 1.0)] == [100] * 10  # switches count as busy


def test_without_a_switch_cost_the_halves_are_exact() -> None:
    engine = make_engine(timeslice_s=0.002, switch_s=0.0)
    two_busy(engine)
    for t in (0.0071, 0.25, 0.6789):
        times = ran(engine, t)
        assert times[1] + times[2] == pytest.approx(t, abs=TOL)  # no time lost to switching
    assert ran(engine, 1.0) == pytest.approx({1: 0.5, 2: 0.5}, abs=TOL)
    assert engine.busy_s == pytest.approx(1.0, abs=TOL)


def test_a_context_alone_pays_one_switch_at_first_load_and_none_after() -> None:
    engine = make_engine(switch_s=0.00025)
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 100, 0.01, 0.0)  # 1 s of work
    assert ran(engine, 1.0) == pytest.approx({1: 0.99975}, abs=TOL)  # the first load: 0.25 ms
    assert engine.busy_s == pytest.approx(1.0, abs=TOL)
    assert engine.when_completed({ctx.cid: ctx.queued}) == pytest.approx({ctx.cid: 1.00025}, abs=TOL)
    engine.submit(ctx, 30, 0.01, 2.0)  # idle a second, its state still loaded: no switch
    assert engine.when_completed({ctx.cid: 30}) == pytest.approx({ctx.cid: 2.3}, abs=TOL)
    assert ran(engine, 3.0) == pytest.approx({1: 1.3}, abs=TOL)
    assert engine.busy_s == pytest.approx(1.30025, abs=TOL)


def test_predicted_completions_include_the_switches() -> None:
    """a 10 ms, b 3 ms, 2 ms slices, 1 ms switches: sw 0-1, a 1-3, sw 3-4, b 4-6, sw 6-7,
    a 7-9, sw 9-10, b 10-11 (done), sw 11-12, a 12-18 alone."""
    engine = make_engine(timeslice_s=0.002, switch_s=0.001)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0)
    engine.submit(a, 1, 0.010, 0.0)
    engine.submit(b, 1, 0.003, 0.0)
    assert engine.when_completed({a.cid: 1, b.cid: 1}) == pytest.approx({a.cid: 0.018, b.cid: 0.011}, abs=TOL)
    assert ran(engine, 0.0115) == pytest.approx({1: 0.004, 2: 0.003}, abs=TOL)
    assert ran(engine, 0.018) == pytest.approx({1: 0.010, 2: 0.003}, abs=TOL)
    assert engine.busy_s == pytest.approx(0.018, abs=TOL)


def test_the_context_after_a_destroyed_loaded_one_pays_a_switch() -> None:
    """4 ms slices, 1 ms switches: sw 0-1, a 1-3 when a is destroyed; b loads 3-4, runs 4-10."""
    engine = make_engine(timeslice_s=0.004, switch_s=0.001)
    two_busy(engine)
    a = engine.contexts[0]
    assert ran(engine, 0.003) == pytest.approx({1: 0.002, 2: 0.0}, abs=TOL)
    engine.destroy_context(a, 0.003)
    assert ran(engine, 0.0035) == pytest.approx({2: 0.0}, abs=TOL)
    assert ran(engine, 0.010) == pytest.approx({2: 0.006}, abs=TOL)
    assert engine.busy_s == pytest.approx(0.010, abs=TOL)


def test_destroying_a_context_that_is_not_loaded_costs_the_loaded_one_no_switch() -> None:
    """a, b, c with 4 ms slices, 1 ms switches: sw 0-1 a 1-5, sw 5-6 b 6-10, sw 10-11 c 11-..;
    a destroyed at 12 ms: c goes on running at once."""
    engine = make_engine(timeslice_s=0.004, switch_s=0.001)
    contexts = [engine.create_context(pid, pid, 0.0) for pid in (1, 2, 3)]
    for ctx in contexts:
        engine.submit(ctx, 100, 0.01, 0.0)
    assert ran(engine, 0.012) == pytest.approx({1: 0.004, 2: 0.004, 3: 0.001}, abs=TOL)
    engine.destroy_context(contexts[0], 0.012)
    assert ran(engine, 0.015) == pytest.approx({2: 0.004, 3: 0.004}, abs=TOL)


def test_device_samples_count_switch_time_as_busy() -> None:
    """A 10 ms switch at first load, then 50 ms of work: the period was busy 60 % of its time,
    though the context ran 50 ms."""
    engine = make_engine(switch_s=0.01)
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 5, 0.01, 0.0)
    assert engine.device_samples(0, 0.2) == [DeviceSample(stamp(1), 60), DeviceSample(stamp(2), 0)]
    assert ran(engine, 0.2) == pytest.approx({1: 0.05}, abs=TOL)
    assert engine.busy_s == pytest.approx(0.06, abs=TOL)


def test_reading_the_engine_at_slice_ends_does_not_change_the_schedule() -> None:
    """The schedule may not depend on when someone asks: 2 ms slices read every 1 ms must
    alternate a 0-2, b 2-4, a 4-6, b 6-8, a 8-10 ms as one read at 10 ms does."""
    once = make_engine(timeslice_s=0.002, switch_s=0.0)
    two_busy(once)
    assert ran(once, 0.010) == pytest.approx({1: 0.006, 2: 0.004}, abs=TOL)
    stepped = make_engine(timeslice_s=0.002, switch_s=0.0)
    two_busy(stepped)
    for ms in range(1, 11):
        times = ran(stepped, ms / 1000)
        assert abs(times[1] - times[2]) <= 0.002 + TOL, (ms, times)  # at most one slice apart
    assert times == pytest.approx({1: 0.006, 2: 0.004}, abs=TOL)


def test_two_burns_with_slice_long_kernels_and_a_short_queue_share_fairly() -> None:
    """Two gpu_burn-like programs, 2 ms kernels (= the timeslice), a queue of 16 launches (a
    blocked launch waits for one kernel to complete): free switches, so 0.5 s each in 1 s."""
    node = VirtualNode([EngineConfig.ideal(sample_period_s=PERIOD, queue_depth=16)])
    burns = [
        node.spawn(0, pattern_program(PatternSpec("burn", kernel_ms=2), WorkloadStats())) for _ in (1, 2)
    ]
    node.run_until(1.0)
    assert [p.ctx.ran for p in burns] == pytest.approx([0.5, 0.5], abs=0.002 + TOL)


# Host wake-ups ------------------------------------------------------------------------------------


def stepper(step_s: float, returned: list[float]) -> Program:
    """One kernel of ``step_s`` and a sync, for ever; records when each sync returned."""
    while True:
        yield Launch(1, step_s)
        returned.append((yield Sync()))


def test_after_each_sync_the_host_runs_again_within_half_the_mean_either_side() -> None:
    """Alone on the GPU (its state stays loaded: one switch, at the start), a step of 4 ms
    drains at launch + 4 ms; the sync returns host_wake x U(0.5, 1.5) later (seeded)."""
    step, wake, switch = 0.004, 0.002, 0.00025
    node = VirtualNode([config(host_wake_s=wake, switch_s=switch)])
    returned: list[float] = []
    proc = node.spawn(0, stepper(step, returned))
    node.run_until(1.0)
    launches = [0.0, *returned]
    drains = [launches[0] + switch + step] + [t + step for t in launches[1:-1]]
    waits = [back - drained for back, drained in zip(returned, drains, strict=False)]
    assert len(waits) >= 150
    assert all(0.5 * wake - TOL <= w <= 1.5 * wake + TOL for w in waits), (min(waits), max(waits))
    assert max(waits) - min(waits) > 0.8 * wake  # the jitter spans most of its range
    assert sum(waits) / len(waits) == pytest.approx(wake, rel=0.1)
    # The GPU is busy step/(step + wake) of the time, within the jitter's bounds.
    busy = proc.ctx.ran / 1.0
    assert step / (step + 1.5 * wake) <= busy <= step / (step + 0.5 * wake)
    assert busy == pytest.approx(step / (step + wake), rel=0.03)


def test_a_train_loop_alone_keeps_the_gpu_busy_step_over_step_plus_wake() -> None:
    """train: 20 kernels of 2 ms (a 40 ms step) and a sync, with the default 50 µs wake-up:
    0.99875 busy on average, 0.99813..0.99938 at the jitter's bounds."""
    node = VirtualNode([config()])
    stats = WorkloadStats()
    proc = node.spawn(0, pattern_program(PatternSpec("train", kernels=20, kernel_ms=2), stats))
    node.run_until(2.0)
    step, wake = 0.040, EngineConfig().host_wake_s
    busy = proc.ctx.ran / 2.0
    assert step / (step + 1.5 * wake) - 0.00025 <= busy <= step / (step + 0.5 * wake)  # -0.25 ms: first load
    assert stats.syncs == 49  # 2 s / (40 ms + ~50 µs): the 50th step is still running


def test_without_a_wake_up_a_train_loop_keeps_the_gpu_fully_busy() -> None:
    node = VirtualNode([config(host_wake_s=0.0)])
    proc = node.spawn(0, pattern_program(PatternSpec("train", kernels=20, kernel_ms=2), WorkloadStats()))
    node.run_until(2.0)
    assert proc.ctx.ran == pytest.approx(2.0 - 0.00025, abs=TOL)  # all but the first load
    assert node.engines[0].busy_s == pytest.approx(2.0, abs=TOL)


def test_a_launch_blocked_on_a_full_queue_returns_without_a_wake_up() -> None:
    """burn never syncs: its blocked launches return as kernels complete, so however slow the
    host is to wake after a sync, the GPU stays busy."""
    node = VirtualNode([config(host_wake_s=0.05, queue_depth=16)])
    proc = node.spawn(0, pattern_program(PatternSpec("burn", kernel_ms=2), WorkloadStats()))
    node.run_until(1.0)
    assert proc.ctx.ran == pytest.approx(1.0 - 0.00025, abs=TOL)


def test_host_wake_ups_are_seeded() -> None:
    def run(seed: int) -> list[float]:
        node = VirtualNode([config(host_wake_s=0.002, seed=seed)])
        returned: list[float] = []
        node.spawn(0, stepper(0.004, returned))
        node.run_until(0.2)
        return returned

    assert run(1) == run(1)
    assert run(1) != run(2)


# The driver's samples ------------------------------------------------------------------------------

# 2 ms slices and 0.35 ms switches: a round of 4.7 ms, [sw, a, sw, b]; no period end of the
# first 2 s falls within 0.1 ms of a boundary of it: who is loaded at each one is unambiguous.
SLICE, SWITCH = 0.002, 0.00035
ROUND = 2 * (SLICE + SWITCH)


def loaded_at(t: float) -> int:
    """Whose state is loaded at ``t`` (two contexts from 0): a's from the end of the switch
    to it until the end of the switch to b (the one switched out stays loaded until then)."""
    phase = math.fmod(t, ROUND)
    edges = (0.0, SWITCH, 2 * SWITCH + SLICE, ROUND)
    assert min(abs(phase - e) for e in edges) > 1e-6, f"{t} is on a boundary of the schedule"
    return 1 if SWITCH < phase < 2 * SWITCH + SLICE else 2


def history(engine: GpuEngine, periods: int) -> list[dict[int, float]]:
    """GPU time per pid at every period end 0..``periods`` (index 0: the start)."""
    out = [{1: 0.0, 2: 0.0}]
    for k in range(1, periods + 1):
        out.append(ran(engine, k * PERIOD))
    return out


def test_one_sample_per_period_credits_the_process_executing_at_its_end_resident() -> None:
    """Resident credit: the executing process's own SM activity over the credit window (1 s:
    10 periods, fewer at the start: the periods recorded so far). The other process ran in the
    period too and gets nothing for it."""
    engine = make_engine(timeslice_s=SLICE, switch_s=SWITCH, credit_window_s=1.0)
    two_busy(engine)
    times = history(engine, 20)
    expected = []
    for k in range(1, 21):
        pid = loaded_at(k * PERIOD)
        first = max(0, k - 10)
        own = times[k][pid] - times[first][pid]
        expected.append(Sample(pid, stamp(k), round(100 * SM * own / ((k - first) * PERIOD))))
    assert all(times[k][p] > times[k - 1][p] for k in range(1, 21) for p in (1, 2))  # both ran in each
    samples = engine.driver_samples(0, 2.0)
    assert samples == expected  # one sample per period, for the one loaded at its end
    assert {s.pid for s in samples} == {1, 2}  # both get turns at the instants
    assert all(36 <= s.sm_util <= 38 for s in samples)  # 0.867 x 0.4255 s of each second = 37 %


def test_engine_credit_gives_the_executing_process_the_whole_engines_activity() -> None:
    engine = make_engine(timeslice_s=SLICE, switch_s=SWITCH, sample_credit="engine")
    two_busy(engine)
    times = history(engine, 20)
    expected = []
    for k in range(1, 21):
        both = sum(times[k][p] - times[k - 1][p] for p in (1, 2))
        expected.append(Sample(loaded_at(k * PERIOD), stamp(k), round(100 * SM * both / PERIOD)))
    assert engine.driver_samples(0, 2.0) == expected
    assert {s.sm_util for s in expected} == {74}  # 0.867 x 2 ms / 2.35 ms


def test_the_credit_window_is_rounded_to_whole_periods() -> None:
    """a runs 0.3 s alone (0.3 ms first load: done at 0.3003 s, the end of its slice), then b,
    queued at 0.3 s, loads (0.3003-0.3006) and runs alone. With a 0.3 s window (3 periods), b's
    samples climb to 0.867 in three periods; 0.26 s rounds to the same 3 periods."""
    for window in (0.3, 0.26):
        engine = make_engine(switch_s=0.0003, credit_window_s=window)
        a = engine.create_context(1, 10, 0.0)
        engine.submit(a, 30, 0.01, 0.0)
        b = engine.create_context(2, 20, 0.3)
        engine.submit(b, 300, 0.01, 0.3)
        b_ran = {k: max(0.0, k * PERIOD - 0.3006) for k in range(1, 8)}  # at each period end
        assert ran(engine, 0.75) == pytest.approx({1: 0.3, 2: b_ran[7] + 0.05}, abs=TOL)
        got = [s for s in engine.driver_samples(0, 0.75) if s.timestamp_us > stamp(3)]
        assert got == [
            Sample(2, stamp(k), round(100 * SM * (b_ran[k] - b_ran[k - 3]) / 0.3)) for k in (4, 5, 6, 7)
        ], window
        assert [s.sm_util for s in got] == [29, 58, 87, 87]


def test_resident_credit_is_the_processs_own_sm_activity() -> None:
    """Alone and busy for a whole window, a process reads its kernels' SM activity: 0.867 by
    default, what it was created with otherwise (clamped to 0.01..1)."""
    for activity, reads in ((None, 87), (0.5, 50), (2.0, 100), (0.0, 1)):
        engine = make_engine(switch_s=0.0)
        ctx = engine.create_context(1, 10, 0.0, sm_activity=activity)
        engine.submit(ctx, 300, 0.01, 0.0)
        assert {s.sm_util for s in engine.driver_samples(0, 2.0)} == {reads}, activity
        assert {s.pid for s in engine.driver_samples(0, 2.0)} == {1}


def test_a_sample_taken_while_the_engine_idles_credits_nobody() -> None:
    """50 ms of work in period 0: the engine idles at its end, so the sample credits pid 0 and
    the process's time is lost to NVML, while the device sample shows the period 50 % busy."""
    engine = make_engine(switch_s=0.0)
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 5, 0.01, 0.0)
    assert engine.driver_samples(0, 0.35) == [Sample(NO_PROCESS, stamp(k), 0) for k in (1, 2, 3)]
    assert engine.samples(0, 0.35) == []  # NVML never returns pid 0
    assert [s.util for s in engine.device_samples(0, 0.35)] == [50, 0, 0]
    assert engine.device_utilization(0.35) == 0


def test_a_destroyed_contexts_work_still_counts_in_the_engines_activity() -> None:
    """a (0.867) and b (0.5) alternate 2 ms slices; a exits at 50 ms having run 26 ms, b runs
    alone after: the period's sample credits b with 0.867 x 26 ms + 0.5 x 74 ms = 60 %."""
    engine = make_engine(sample_credit="engine", switch_s=0.0, timeslice_s=0.002)
    a = engine.create_context(1, 10, 0.0)
    b = engine.create_context(2, 20, 0.0, sm_activity=0.5)
    engine.submit(a, 100, 0.01, 0.0)
    engine.submit(b, 100, 0.01, 0.0)
    engine.destroy_context(a, 0.05)
    assert a.ran == pytest.approx(0.026, abs=TOL)
    assert engine.driver_samples(0, 0.1) == [
        Sample(2, stamp(1), round(100 * (SM * 0.026 + 0.5 * 0.074) / 0.1))
    ]


def test_device_samples_cover_every_period_idle_stretches_included_and_are_visible_at_once() -> None:
    """Work of 50 ms at 0 and of 120 ms at 0.5 s (the engine skips 0.1-0.5 s in one step when
    the second arrives, and 0.7-2 s when it is read): a device sample for each of the 20
    periods, readable at its period's end though per-process samples lag 0.25 s."""
    engine = make_engine(switch_s=0.0, sample_delay_s=0.25)
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 5, 0.01, 0.0)
    engine.submit(ctx, 12, 0.01, 0.5)
    utils = [0] * 20
    utils[0], utils[5], utils[6] = 50, 100, 20
    assert engine.device_samples(0, 2.0) == [DeviceSample(stamp(k + 1), u) for k, u in enumerate(utils)]
    assert (
        engine.device_samples(stamp(6), 2.0)
        == [DeviceSample(stamp(k + 1), u) for k, u in enumerate(utils)][6:]
    )

    fresh = make_engine(switch_s=0.0, sample_delay_s=0.25)
    ctx = fresh.create_context(1, 10, 0.0)
    fresh.submit(ctx, 5, 0.01, 0.0)
    assert fresh.device_samples(0, 0.0999) == []
    assert fresh.device_samples(0, 0.1) == [DeviceSample(stamp(1), 50)]
    assert fresh.device_utilization(0.1) == 50
    assert fresh.driver_samples(0, 0.1) == []  # the per-process one: 0.25 s later
    assert fresh.driver_samples(0, 0.35) == [Sample(NO_PROCESS, stamp(1), 0)]


def first_seen(read: Callable[[float], list[Sample]], start: float, end: float) -> dict[int, float]:
    """The first time (read every ms) each timestamp was visible."""
    seen: dict[int, float] = {}
    for ms in range(round(start * 1000), round(end * 1000) + 1):
        for sample in read(ms / 1000):
            seen.setdefault(sample.timestamp_us, ms / 1000)
    return seen


def test_driver_samples_are_visible_after_the_delay_plus_bounded_jitter_in_order() -> None:
    engine = make_engine(sample_delay_s=0.25, sample_jitter_s=0.25, seed=3)
    two_busy(engine, 2.0)
    seen = first_seen(lambda now: engine.driver_samples(0, now), 0.001, 3.0)
    assert sorted(seen) == [stamp(k) for k in range(1, 26)]  # one per period, 2.5 s
    lateness = [seen[ts] - ts / 1e6 for ts in sorted(seen)]
    assert all(0.25 - TOL <= late <= 0.5 + 0.001 + TOL for late in lateness), lateness
    assert max(lateness) - min(lateness) > 0.1
    order = [seen[ts] for ts in sorted(seen)]
    assert order == sorted(order)


def test_samples_of_an_idle_stretch_read_late_are_visible_after_their_own_delay() -> None:
    """50 ms of work, then nobody reads the engine until 1 s: the samples of the periods that
    ended by 0.75 s are due by then (0.25 s delay, no jitter)."""
    engine = make_engine(switch_s=0.0, sample_delay_s=0.25)
    ctx = engine.create_context(1, 10, 0.0)
    engine.submit(ctx, 5, 0.01, 0.0)
    seen = first_seen(lambda now: engine.driver_samples(0, now), 1.0, 2.0)
    lateness = {ts: round(seen[ts] - ts / 1e6, 3) for ts in sorted(seen)}
    assert all(late <= 0.25 + 0.001 for ts, late in lateness.items() if ts >= stamp(8)), lateness
    assert sorted(ts for ts, at in seen.items() if at == 1.0) == [stamp(k) for k in range(1, 8)]


# The exact view -----------------------------------------------------------------------------------------


def ideal_engine(**fields: Any) -> GpuEngine:
    base: dict[str, Any] = {"sample_period_s": PERIOD, "sample_delay_s": 0.0, "sample_jitter_s": 0.0}
    return GpuEngine(EngineConfig.ideal(**(base | fields)), 0.0, 0.0)


def test_the_exact_view_gives_every_process_that_ran_its_share_of_each_period() -> None:
    """a, b busy; c queues 30 ms at 0.1 s: three-way 2 ms slices until c is done (0.19 s),
    then a 0.19-0.191, b, a, b, a: a 36 ms, b 34 ms, c 30 ms of period 2; c then gets none."""
    engine = ideal_engine()
    two_busy(engine)
    c = engine.create_context(3, 30, 0.1)
    engine.submit(c, 3, 0.01, 0.1)
    assert engine.samples(0, 0.35) == [
        Sample(1, stamp(1), 50),
        Sample(2, stamp(1), 50),
        *[Sample(p, stamp(2), u) for p, u in ((1, 36), (2, 34), (3, 30))],
        *[Sample(p, stamp(3), u) for p, u in ((1, 50), (2, 50))],
    ]
    assert engine.driver_samples(0, 0.35) == engine.samples(0, 0.35)


def test_the_exact_view_ignores_the_nvml_aggregation() -> None:
    for aggregation in ("per-sample", "per-call", "per-call-last"):
        engine = ideal_engine(nvml_aggregation=aggregation)
        two_busy(engine)
        assert engine.samples(0, 0.35) == [Sample(p, stamp(k), 50) for k in (1, 2, 3) for p in (1, 2)]


def test_ideal_is_the_engine_without_the_hardwares_inconveniences() -> None:
    ideal = EngineConfig.ideal()
    assert (ideal.switch_s, ideal.host_wake_s, ideal.sm_activity, ideal.nvml_view) == (0.0, 0.0, 1.0, "exact")
    assert dataclasses.replace(
        ideal, switch_s=0.00025, host_wake_s=0.00005, sm_activity=SM, nvml_view="driver"
    ) == (EngineConfig())
    assert EngineConfig.ideal(switch_s=0.001, queue_depth=8).switch_s == 0.001  # fields override
    assert EngineConfig.ideal(queue_depth=8).queue_depth == 8
    defaults = EngineConfig()
    assert (defaults.nvml_view, defaults.nvml_aggregation, defaults.sample_credit) == (
        "driver",
        "per-sample",
        "resident",
    )
    assert (defaults.switch_s, defaults.host_wake_s, defaults.credit_window_s) == (0.00025, 0.00005, 1.0)


# The NVML library's aggregation -------------------------------------------------------------------------

RING = [
    Sample(1, 100, 40),
    Sample(2, 200, 30),
    Sample(NO_PROCESS, 300, 0),
    Sample(1, 400, 50),
    Sample(1, 500, 0),  # credited, at zero: counts as a sample of the span, never returned
    Sample(2, 600, 90),
]


def test_per_sample_returns_every_credited_non_zero_sample_newer_than_since() -> None:
    assert process_utilization(RING, 0, "per-sample") == [RING[0], RING[1], RING[3], RING[5]]
    assert process_utilization(RING, 100, "per-sample") == [RING[1], RING[3], RING[5]]  # exclusive
    assert process_utilization(RING, 399, "per-sample") == [RING[3], RING[5]]
    assert process_utilization(RING, 600, "per-sample") == []


def test_per_call_returns_each_process_once_its_mean_over_the_span() -> None:
    """Six samples in the span: pid 1 credited 40+50+0, pid 2 30+90: their sums over 6."""
    assert process_utilization(RING, 0, "per-call") == [Sample(1, 500, 15), Sample(2, 600, 20)]
    # since 100 (exclusive): 5 samples, 200..600: pid 1 50/5, pid 2 120/5.
    assert process_utilization(RING, 100, "per-call") == [Sample(1, 500, 10), Sample(2, 600, 24)]
    # since 200: 4 samples (300..600): pid 1 50/4, pid 2 90/4; pid 2 is the newer one.
    assert process_utilization(RING, 200, "per-call") == [Sample(1, 500, 12), Sample(2, 600, 22)]
    assert process_utilization(RING, 500, "per-call") == [Sample(2, 600, 90)]
    assert process_utilization(RING, 600, "per-call") == []
    # Only pid 0 and zero credits newer than since: nothing.
    assert process_utilization(RING[2:5:2], 200, "per-call") == []


def test_per_call_last_returns_only_the_processes_credited_in_the_newest_sample() -> None:
    assert process_utilization(RING, 0, "per-call-last") == [Sample(2, 600, 20)]
    assert process_utilization(RING, 0, "per-call-last") == [
        s for s in process_utilization(RING, 0, "per-call") if s.pid == 2
    ]
    assert process_utilization(RING[:5], 0, "per-call-last") == []  # newest: pid 1 at zero
    assert process_utilization(RING[1:4], 0, "per-call-last") == [Sample(1, 400, 17)]  # 50 / 3
    assert process_utilization(RING[:3], 0, "per-call-last") == []  # newest: pid 0


def test_per_call_with_several_processes_per_timestamp_counts_timestamps() -> None:
    """Per-process samples (MPS clients, the exact view): the span is the number of distinct
    timestamps; processes in the newest one are ordered by pid in per-call-last."""
    samples = [Sample(3, 100, 30), Sample(4, 100, 60), Sample(4, 200, 60), Sample(3, 200, 20)]
    assert process_utilization(samples, 0, "per-call") == [Sample(3, 200, 25), Sample(4, 200, 60)]
    assert process_utilization(samples, 0, "per-call-last") == [Sample(3, 200, 25), Sample(4, 200, 60)]
    assert process_utilization(samples, 0, "per-sample") == samples


def test_the_engine_aggregates_its_driver_samples_per_call_as_configured() -> None:
    """Engine credit, SM activity 1, no switches: a runs 0.45 s of work (the last 50 ms queued
    at 0.35 s); the engine idles at 0.5 s (pid 0), so a is credited 100 in periods 1-4 only."""
    answers = {}
    for aggregation in ("per-sample", "per-call", "per-call-last"):
        engine = make_engine(
            sample_credit="engine", sm_activity=1.0, switch_s=0.0, nvml_aggregation=aggregation
        )
        ctx = engine.create_context(1, 10, 0.0)
        engine.submit(ctx, 4, 0.1, 0.0)
        engine.submit(ctx, 1, 0.05, 0.35)
        driver = engine.driver_samples(0, 1.0)
        assert driver == [
            *[Sample(1, stamp(k), 100) for k in (1, 2, 3, 4)],
            *[Sample(NO_PROCESS, stamp(k), 0) for k in range(5, 11)],
        ]
        for since in (0, stamp(2), stamp(4), stamp(9)):
            assert engine.samples(since, 1.0) == process_utilization(driver, since, aggregation)
        answers[aggregation] = engine.samples(0, 1.0)
    assert answers == {
        "per-sample": [Sample(1, stamp(k), 100) for k in (1, 2, 3, 4)],
        "per-call": [Sample(1, stamp(4), 40)],  # 400 over the 10 samples of the call
        "per-call-last": [],  # the newest sample credits nobody
    }


# MPS under the driver view -----------------------------------------------------------------------------


def mps_engine(**fields: Any) -> GpuEngine:
    engine = make_engine(**fields)
    engine.attach_mps_server(SERVER, 0.0)
    for pid, share in ((1, 0.3), (2, 0.6)):
        ctx = engine.create_context(pid, pid, 0.0, share=share, mps_client=True)
        engine.submit(ctx, 1000, 0.02, 0.0)
    return engine


def test_mps_clients_work_is_credited_to_the_server_in_one_sample_per_period() -> None:
    """0.3 + 0.6 of the GPU at 0.867 SM activity: 78 %, the server's, every period."""
    engine = mps_engine()
    assert engine.driver_samples(0, 2.0) == [Sample(SERVER, stamp(k), 78) for k in range(1, 21)]
    assert engine.samples(0, 2.0) == engine.driver_samples(0, 2.0)
    engine = mps_engine(sample_credit="engine", nvml_aggregation="per-call")
    assert engine.samples(0, 2.0) == [Sample(SERVER, stamp(20), 78)]


def test_mps_client_attribution_gives_each_client_its_own_exact_samples() -> None:
    engine = mps_engine(mps_samples="client")
    expected = [Sample(pid, stamp(k), u) for k in range(1, 11) for pid, u in ((1, 30), (2, 60))]
    assert engine.driver_samples(0, 1.0) == expected
    assert engine.samples(0, 1.0) == expected


def test_mps_without_a_server_gives_each_client_its_own_samples() -> None:
    engine = make_engine(mps=True)
    for pid, share in ((1, 0.3), (2, 0.5)):
        ctx = engine.create_context(pid, pid, 0.0, share=share)
        engine.submit(ctx, 1000, 0.02, 0.0)
    assert engine.samples(0, 0.35) == [
        Sample(pid, stamp(k), u) for k in (1, 2, 3) for pid, u in ((1, 30), (2, 50))
    ]


def test_an_idle_mps_gpu_credits_nobody_however_often_it_is_read() -> None:
    """One client at half the GPU runs 0.125 s of work: done at 0.25 s. From then on the
    engine idles at every period end, as a time-sliced one would: pid 0, whether it is read
    every 50 ms or once."""
    answers = []
    for step in (0.05, 1.5):
        engine = make_engine()
        engine.attach_mps_server(SERVER, 0.0)
        ctx = engine.create_context(1, 1, 0.0, share=0.5, mps_client=True)
        engine.submit(ctx, 1, 0.125, 0.0)
        for k in range(1, round(1.5 / step) + 1):
            engine.advance(k * step)
        answers.append(engine.driver_samples(0, 1.5))
    assert answers[0][:2] == [Sample(SERVER, stamp(k), 43) for k in (1, 2)]  # 0.867 x 0.5
    assert answers[0][2:] == [Sample(NO_PROCESS, stamp(k), 0) for k in range(3, 16)]
    assert answers[0] == answers[1]


# Configuration ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("nvml_view", "ideal", "NVML view must be one of driver, exact, got 'ideal'"),
        (
            "nvml_aggregation",
            "mean",
            "NVML aggregation must be one of per-sample, per-call, per-call-last, got 'mean'",
        ),
        ("sm_activity", 0.0, "SM activity must be 0.01..1, got 0"),
        ("sm_activity", 1.5, "SM activity must be 0.01..1, got 1.5"),
        ("sample_credit", "process", "sample credit must be one of resident, engine, got 'process'"),
        ("credit_window_s", 0.0, "credit window must be > 0 and <= 10 s, got 0 s"),
        ("credit_window_s", 11.0, "credit window must be > 0 and <= 10 s, got 11 s"),
        ("host_wake_s", -0.001, "host wake-up must be 0..100 ms, got -1 ms"),
        ("host_wake_s", 0.2, "host wake-up must be 0..100 ms, got 200 ms"),
        ("switch_s", -0.001, "context switch must be 0..100 ms, got -1 ms"),
        ("switch_s", 0.15, "context switch must be 0..100 ms, got 150 ms"),
        ("mps_samples", "both", "MPS samples must be one of server, client, got 'both'"),
    ],
)
def test_config_problems_name_each_new_field(field: str, value: Any, named: str) -> None:
    bad = dataclasses.replace(EngineConfig(), **{field: value})
    assert bad.problems() == [named]
    with pytest.raises(InvalidSpecError, match=named.split(",", maxsplit=1)[0]):
        GpuEngine(bad, 0.0, 0.0)


def test_the_new_fields_bounds_are_valid() -> None:
    for fields in (
        {"sm_activity": 0.01, "switch_s": 0.0, "host_wake_s": 0.0, "credit_window_s": 10.0},
        {"sm_activity": 1.0, "switch_s": 0.1, "host_wake_s": 0.1, "credit_window_s": 0.001},
        {"nvml_view": "exact", "nvml_aggregation": "per-call-last", "sample_credit": "engine"},
    ):
        assert EngineConfig(**fields).problems() == [], fields
    every = EngineConfig(
        nvml_view="",
        nvml_aggregation="",
        sm_activity=2,
        switch_s=1,
        sample_credit="",
        credit_window_s=-1,
        host_wake_s=1,
    )
    assert len(every.problems()) == 7
