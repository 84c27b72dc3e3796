"""A simulated workload's options: validation, its MPS share, and memory that grows."""

from __future__ import annotations

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program, with_memory
from agent.platform.gpu.sim.virtual import VirtualNode
from agent.platform.gpu.sim.workload import WorkloadSpec, mps_share, report

MIB = 1 << 20


@pytest.mark.parametrize(
    ("grow_to", "after", "message"), [(-1, 0.0, "--grow-to-mib"), (100, -0.5, "--grow-after")]
)
def test_growth_options_are_validated(grow_to: int, after: float, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        WorkloadSpec(gpu=0, memory_mib=1, grow_to_mib=grow_to, grow_after_s=after).validate()


def test_every_bad_option_is_named_at_once() -> None:
    spec = WorkloadSpec(gpu=0, pattern=PatternSpec("train", busy=2.0), memory_mib=-1, duration_s=0)
    with pytest.raises(InvalidSpecError) as raised:
        spec.validate()
    assert all(name in str(raised.value) for name in ("--busy", "--memory-mib", "--duration"))


@pytest.mark.parametrize(("raw", "share"), [("", 100.0), ("30", 30.0), (" 12.5 ", 12.5)])
def test_the_mps_share_comes_from_the_cuda_environment(raw: str, share: float) -> None:
    assert mps_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": raw}) == share


@pytest.mark.parametrize("raw", ["abc", "0", "101"])
def test_a_bad_mps_share_is_a_clear_error(raw: str) -> None:
    with pytest.raises(InvalidSpecError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        mps_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": raw})


def test_memory_grows_once_after_its_deadline() -> None:
    node = VirtualNode([EngineConfig.ideal()])
    program = with_memory(pattern_program(PatternSpec("train"), WorkloadStats()), 100, 400, 2.0)
    proc = node.spawn(0, program)
    node.run_until(1.9)
    assert node.engines[0].memory() == {proc.pid: 100 * MIB}
    node.run_until(2.1)  # the first step past the deadline grows it
    assert node.engines[0].memory() == {proc.pid: 400 * MIB}
    node.run_until(10.0)
    assert node.engines[0].memory() == {proc.pid: 400 * MIB}


def test_growth_past_the_gpu_fails_like_cuda() -> None:
    node = VirtualNode([EngineConfig.ideal(memory_bytes=1024 * MIB)])
    program = with_memory(pattern_program(PatternSpec("train"), WorkloadStats()), 100, 2048, 0.5)
    proc = node.spawn(0, program)
    node.run_until(1.0)
    assert proc.done and "out of memory" in proc.error
    assert node.engines[0].memory() == {}


def test_the_report_leaves_out_requests_answered_before_latency_after() -> None:
    stats = WorkloadStats(started_at=100.0)
    for i in range(5):
        stats.record(2.0, answered_at=101.0 + i / 10)  # start-up: slow
    for i in range(95):
        stats.record(0.1, answered_at=106.0 + i)
    spec = WorkloadSpec(gpu=0, pattern=PatternSpec("infer"), latency_after_s=5.0)
    got = report(spec, stats)
    assert (got["latency_p50_ms"], got["latency_p99_ms"], got["requests"]) == (100.0, 100.0, 100)
    everything = report(WorkloadSpec(gpu=0, pattern=PatternSpec("infer")), stats)
    assert everything["latency_p99_ms"] == 2000.0
    with pytest.raises(InvalidSpecError, match="--latency-after must be >= 0"):
        WorkloadSpec(gpu=0, latency_after_s=-1).validate()
