"""The simulated CUDA programs' patterns, run in virtual time against one simulated GPU."""

from __future__ import annotations

import statistics

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import (
    BURN_BATCH,
    Alloc,
    Launch,
    Op,
    PatternSpec,
    Program,
    Sleep,
    WorkloadStats,
    pattern_program,
    with_memory,
)
from agent.platform.gpu.sim.virtual import VirtualNode, VirtualProcess

MIB = 1 << 20
TOL = 1e-6


def start(
    spec: PatternSpec, config: EngineConfig | None = None
) -> tuple[VirtualNode, VirtualProcess, WorkloadStats]:
    node = VirtualNode([config or EngineConfig.ideal()])
    stats = WorkloadStats()
    return node, node.spawn(0, pattern_program(spec, stats)), stats


def gpu_time(engine: GpuEngine, now: float, pid: int) -> float:
    return {c.pid: c.ran_s for c in engine.truth(now)}[pid]


# train ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("busy", "kernels", "kernel_ms"), [(0.5, None, None), (0.25, 10, 5.0), (0.8, 4, 1.0)]
)
def test_train_alone_keeps_the_gpu_busy_its_busy_share(
    busy: float, kernels: int | None, kernel_ms: float | None
) -> None:
    spec = PatternSpec("train", kernels=kernels, kernel_ms=kernel_ms, busy=busy)
    node, proc, stats = start(spec)
    step = spec.n_kernels * spec.kernel_s
    cycles = round(10.0 * busy / step)  # steps, each followed by its think time, in 10 s
    end = 10.0 + step / 2  # half-way through the next step
    node.run_until(end)
    assert spec.demand() == busy
    assert gpu_time(node.engines[0], end, proc.pid) == pytest.approx(10.0 * busy + step / 2, abs=TOL)
    assert stats.syncs == cycles
    assert stats.launches == (cycles + 1) * spec.n_kernels


def test_train_samples_read_its_busy_share() -> None:
    """40 ms steps, 40 ms think: every 0.1 s period reads 40, 50 or 60 %, 50 on average."""
    config = EngineConfig.ideal(sample_period_s=0.1, sample_delay_s=0.0, sample_jitter_s=0.0)
    node, proc, _ = start(PatternSpec("train", busy=0.5), config)
    node.run_until(4.0)
    utils = [s.sm_util for s in node.engines[0].samples(0, 4.0) if s.pid == proc.pid]
    assert len(utils) == 40
    assert set(utils) <= {40, 50, 60}
    assert statistics.fmean(utils) == pytest.approx(50.0, abs=0.5)


def test_train_at_zero_busy_never_launches() -> None:
    node, proc, stats = start(PatternSpec("train", busy=0.0))
    node.run_until(5.5)
    assert gpu_time(node.engines[0], 5.5, proc.pid) == 0.0
    assert (stats.launches, stats.syncs) == (0, 0)
    assert proc.wake_at == pytest.approx(6.0)  # asleep in 1 s naps


# infer ----------------------------------------------------------------------------------------


def test_infer_at_a_low_rate_uses_rate_times_its_request_work() -> None:
    """5 requests/s of 4 x 2 ms: 4 % of the GPU; alone a request takes its 8 ms unless it
    arrives behind another."""
    spec = PatternSpec("infer", rate=5.0)
    node, proc, stats = start(spec)
    node.run_until(100.0)
    assert spec.demand() == pytest.approx(0.04)
    assert 440 <= stats.requests <= 560  # Poisson(500), seeded
    assert stats.syncs == stats.requests
    assert stats.launches == 4 * stats.requests
    used = gpu_time(node.engines[0], 100.0, proc.pid)
    assert used == pytest.approx(stats.requests * 0.008, abs=TOL)  # every request finished
    assert used / 100.0 == pytest.approx(0.04, abs=0.004)
    assert len(stats.latencies_s) == stats.requests
    assert min(stats.latencies_s) == pytest.approx(0.008, abs=TOL)
    assert stats.latency(0.5) == pytest.approx(0.008, abs=TOL)
    p99 = stats.latency(0.99)
    assert p99 is not None and 0.008 < p99 <= 0.016 + TOL  # queued behind at most one request


def test_infer_latency_doubles_when_it_shares_the_gpu_with_burn() -> None:
    """Its 2 ms kernels alternate with burn's 2 ms slices: 4 of its slices and 3 of burn's,
    plus up to a slice's wait at arrival: 14..16 ms."""
    node = VirtualNode([EngineConfig.ideal(timeslice_s=0.002)])
    stats = WorkloadStats()
    infer = node.spawn(0, pattern_program(PatternSpec("infer", rate=5.0), stats))
    burn = node.spawn(0, pattern_program(PatternSpec("burn"), WorkloadStats()))
    node.run_until(50.0)
    assert min(stats.latencies_s) >= 0.014 - TOL
    p50 = stats.latency(0.5)
    assert p50 is not None and 0.014 - TOL <= p50 <= 0.016 + TOL
    used = gpu_time(node.engines[0], 50.0, infer.pid)
    assert used == pytest.approx(stats.requests * 0.008, abs=0.008 + TOL)  # at most one in flight
    assert gpu_time(node.engines[0], 50.0, burn.pid) == pytest.approx(50.0 - used, abs=TOL)


def test_closed_loop_clients_saturate_the_gpu_with_bounded_latency() -> None:
    """4 clients asking far more than the GPU serves: it is always busy, and a request waits
    behind at most the other three (4 x 8 ms)."""
    node, proc, stats = start(PatternSpec("infer", rate=1000.0, clients=4))
    node.run_until(20.0)
    assert gpu_time(node.engines[0], 20.0, proc.pid) == pytest.approx(20.0, abs=0.01)
    assert stats.requests == pytest.approx(20.0 / 0.008, abs=2)
    p99 = stats.latency(0.99)
    assert p99 is not None and p99 <= 4 * 0.008 + TOL


def test_an_open_loop_past_the_gpu_builds_a_backlog() -> None:
    """Twice what the GPU serves, arriving whatever the latency: the wait grows with time."""
    node, _proc, stats = start(PatternSpec("infer", rate=250.0))
    node.run_until(20.0)
    early, late = stats.latencies_s[:100], stats.latencies_s[-100:]
    assert statistics.fmean(late) > 5.0 > statistics.fmean(early)


def test_a_launch_larger_than_the_queue_tops_it_up_as_it_drains() -> None:
    """30000 launches into a queue of 1024: the queue stays nearly full (refilled 64 at a
    time), so the context never runs dry beside a neighbour (waiting for the queue to
    empty before refilling it let it drain to nothing each time)."""
    node = VirtualNode([EngineConfig.ideal()])
    big = node.spawn(0, iter_ops([Launch(30_000, 0.001)]))
    burn = node.spawn(0, pattern_program(PatternSpec("burn", kernel_ms=1), WorkloadStats()))
    for t in (0.5, 1.0, 2.0, 10.0):
        node.run_until(t)
        assert big.ctx.queued >= 1024 - 64
    engine = node.engines[0]
    assert gpu_time(engine, 10.0, big.pid) == pytest.approx(5.0, abs=0.02)
    assert gpu_time(engine, 10.0, burn.pid) == pytest.approx(5.0, abs=0.02)


def iter_ops(ops: list[Op]) -> Program:
    yield from ops


def test_latency_quantiles() -> None:
    stats = WorkloadStats()
    assert stats.latency(0.5) is None
    for ms in (5, 1, 4, 2, 3):
        stats.record(ms / 1000)
    assert stats.requests == 5
    assert (stats.latency(0.0), stats.latency(0.5), stats.latency(0.99), stats.latency(1.0)) == (
        0.001,
        0.003,
        0.005,
        0.005,
    )


# graph ----------------------------------------------------------------------------------------


def test_a_graph_launch_is_one_queue_entry() -> None:
    """50 x 1 ms kernels per graph, a sync every 4 graphs: 4 entries of 50 ms each."""
    node, proc, stats = start(PatternSpec("graph", sync_every=4))
    engine = node.engines[0]
    [truth] = engine.truth(0.0)
    assert (truth.queued, stats.launches) == (4, 4)
    assert truth.pending_s == pytest.approx(0.2, abs=TOL)
    assert proc.blocked is not None and proc.blocked.sync
    [truth] = engine.truth(0.07)
    assert truth.queued == 3  # the first graph ran 50 ms, as one entry
    assert truth.pending_s == pytest.approx(0.13, abs=TOL)
    node.run_until(0.9)
    [truth] = engine.truth(0.9)
    assert (stats.launches, stats.syncs) == (20, 4)
    assert truth.queued == 2 and truth.pending_s == pytest.approx(0.1, abs=TOL)
    assert truth.ran_s == pytest.approx(0.9, abs=TOL)


# burn -----------------------------------------------------------------------------------------


def test_burn_keeps_its_queue_full_and_blocks_when_it_is() -> None:
    """20 ms kernels into a 1024-deep queue: the 17th batch of 64 blocks until 64 kernels
    (1.28 s) are done, so the queue holds 960..1024 launches all along."""
    node, proc, stats = start(PatternSpec("burn"))
    engine = node.engines[0]
    assert stats.launches == 1024 and engine.truth(0.0)[0].queued == 1024
    depths = []
    for k in range(1, 51):
        node.run_until(k * 0.1)
        depths.append(engine.truth(node.now)[0].queued)
        assert proc.blocked is not None and not proc.blocked.sync
    assert min(depths) >= 1024 - BURN_BATCH and max(depths) <= 1024
    assert depths[-1] == 1024 - round((5.0 - 3 * 1.28) / 0.02)  # refilled at 1.28, 2.56, 3.84 s
    assert stats.launches == 1024 + 3 * BURN_BATCH
    assert stats.syncs == 0
    assert proc.blocked is not None and proc.blocked.left == BURN_BATCH
    assert gpu_time(engine, 5.0, proc.pid) == pytest.approx(5.0, abs=TOL)


def test_burn_syncs_every_sync_every_launches() -> None:
    """1 ms kernels, a sync every 128: 128 ms cycles, the queue empty at each sync's return."""
    node, _, stats = start(PatternSpec("burn", kernel_ms=1.0, sync_every=128))
    node.run_until(1.0)
    assert stats.syncs == 7  # returned at 0.128 .. 0.896 s
    assert stats.launches == 8 * 128
    [truth] = node.engines[0].truth(1.0)
    assert truth.queued == 128 - round((1.0 - 0.896) / 0.001)
    assert truth.ran_s == pytest.approx(1.0, abs=TOL)


# bursty ---------------------------------------------------------------------------------------


def test_bursty_alternates_on_and_off_phases() -> None:
    config = EngineConfig.ideal(sample_period_s=0.1, sample_delay_s=0.0, sample_jitter_s=0.0)
    spec = PatternSpec("bursty", on_s=1.0, off_s=1.0)
    node, proc, stats = start(spec, config)
    node.run_until(6.0)
    assert [on for _, on in stats.phases] == [True, False] * 3
    assert [t for t, _ in stats.phases] == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], abs=0.04 + TOL)
    assert spec.demand() == pytest.approx(0.5)
    assert gpu_time(node.engines[0], 6.0, proc.pid) == pytest.approx(3.0, abs=0.04 + TOL)
    stamps = {s.timestamp_us: s.sm_util for s in node.engines[0].samples(0, 6.0) if s.pid == proc.pid}
    on_periods = [k for k in range(1, 61) if ((k - 1) // 10) % 2 == 0]
    assert sorted(stamps) == [100_000 * k for k in on_periods]  # no samples while off
    assert set(stamps.values()) == {100}


# Specs and memory -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (PatternSpec("spin"), "--pattern must be one of train, infer, burn, graph, bursty, got 'spin'"),
        (PatternSpec(kernels=0), "--kernels must be 1..100000, got 0"),
        (PatternSpec(kernel_ms=0.0), "--kernel-ms must be 0.001..60000, got 0.0"),
        (PatternSpec(busy=1.5), "--busy must be between 0 and 1, got 1.5"),
        (PatternSpec(rate=0.0), "--rate must be > 0 and <= 100000 requests/s, got 0.0"),
        (PatternSpec(sync_every=-1), "--sync-every must be >= 0, got -1"),
        (PatternSpec(on_s=0.0), "--on must be > 0 and --off >= 0, got 0.0 and 3.0"),
        (PatternSpec(off_s=-1.0), "--on must be > 0 and --off >= 0, got 3.0 and -1.0"),
    ],
)
def test_pattern_spec_problems_name_the_bad_option(spec: PatternSpec, named: str) -> None:
    assert spec.problems() == [named]
    with pytest.raises(InvalidSpecError, match=named.split(",", maxsplit=1)[0]):
        pattern_program(spec, WorkloadStats())


def test_pattern_defaults() -> None:
    assert PatternSpec().problems() == []
    specs = [PatternSpec(p) for p in ("train", "infer", "burn", "graph", "bursty")]
    figures = {s.pattern: (s.n_kernels, s.kernel_s, s.syncs_every) for s in specs}
    assert figures == {
        "train": (20, 0.002, 1),
        "infer": (4, 0.002, 1),
        "burn": (1, 0.020, 0),
        "graph": (50, 0.001, 1),
        "bursty": (20, 0.002, 1),
    }
    assert PatternSpec("burn").demand() is None and PatternSpec("graph").demand() is None
    assert PatternSpec("infer", rate=1000.0).demand() == 1.0


def test_with_memory_allocates_first_and_grows_after_its_delay() -> None:
    node = VirtualNode([EngineConfig.ideal()])
    program = with_memory(pattern_program(PatternSpec("train"), WorkloadStats()), 256, 512, 1.0)
    proc = node.spawn(0, program)
    engine = node.engines[0]
    assert engine.memory() == {proc.pid: 256 * MIB}
    node.run_until(0.99)
    assert engine.memory() == {proc.pid: 256 * MIB}
    node.run_until(1.05)  # grown at the first operation past 1 s (a step is 40 ms)
    assert engine.memory() == {proc.pid: 512 * MIB}
    assert gpu_time(engine, 1.05, proc.pid) == pytest.approx(1.05, abs=TOL)  # still training


def test_with_memory_grows_in_steps_on_a_fixed_schedule_and_stops_at_its_target() -> None:
    """64 MiB every 20 ms from 0.5 s, even while the program idles in long host pauses
    (train at busy 0.05: 40 ms steps then 760 ms of Sleep), up to 512 MiB."""
    node = VirtualNode([EngineConfig.ideal()])
    spec = PatternSpec("train", busy=0.05)
    proc = node.spawn(
        0,
        with_memory(
            pattern_program(spec, WorkloadStats()), 128, 512, 0.5, grow_step_mib=64, grow_every_s=0.02
        ),
    )
    engine = node.engines[0]
    node.run_until(0.49)
    assert engine.memory() == {proc.pid: 128 * MIB}
    node.run_until(0.505)
    assert engine.memory() == {proc.pid: 192 * MIB}
    node.run_until(0.545)
    assert engine.memory() == {proc.pid: 320 * MIB}  # steps at 0.50, 0.52, 0.54
    node.run_until(1.0)
    assert engine.memory() == {proc.pid: 512 * MIB}  # 6 steps, then no further


def test_with_memory_passes_the_program_through_unchanged() -> None:
    def program() -> Program:
        now = yield Sleep(0.5)
        yield Alloc(int(now * 100))

    wrapped = with_memory(program(), 0)
    assert next(wrapped) == Sleep(0.0)  # nothing to allocate
    assert wrapped.send(0.0) == Sleep(0.5)
    assert wrapped.send(0.5) == Alloc(50)


def test_an_allocation_the_gpu_cannot_hold_ends_the_process() -> None:
    node = VirtualNode([EngineConfig.ideal(memory_bytes=1024 * MIB)])
    proc = node.spawn(0, with_memory(pattern_program(PatternSpec("burn"), WorkloadStats()), 2048))
    assert proc.done
    assert proc.error == "out of memory on GPU 0: 2048 MiB asked, 1024 MiB free"
    node.run_until(1.0)
    assert node.engines[0].truth(1.0) == [] and node.engines[0].memory() == {}
