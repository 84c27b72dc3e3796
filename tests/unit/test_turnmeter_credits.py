"""The turn meter's reading of containers that run at the same time, on the driver-like
engine in virtual time: the thaw record says only that both could have run; the per-process
credits say who ran how much (agent.domain.credits)."""

from __future__ import annotations

import pytest

from agent.clock import VirtualClock
from agent.control.turnmeter import TurnMeter
from agent.control.usagemeter import container_key
from agent.domain.turns import TurnSettings
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

READ_S = 0.25
WINDOW_S = 10.0


def free_run(
    patterns: dict[str, PatternSpec], sample_period_s: float, seconds: float = 30.0
) -> tuple[dict[str, float], dict[str, float], int]:
    """Every container thawed all along, unheld: (the meter's reading over the last 10 s,
    what really ran then, the corrections made)."""
    clock = VirtualClock(1000.0)
    gpu = VirtualGpuNode(clock, [EngineConfig(sample_period_s=sample_period_s, seed=3)])
    meter = TurnMeter(
        [0], gpu, gpu.owner_of, settings=TurnSettings(), clock=clock, report=lambda _g, _m: None
    )
    keys = {}
    for name, pattern in patterns.items():
        ref = gpu.add(name, 0, pattern_program(pattern, WorkloadStats()))
        keys[name] = container_key(ref.pod_uid, ref.container_id)
        meter.gpus[0].attribution.record(clock.monotonic(), keys[name], True)
        meter.gpus[0].free.add(keys[name])
    start = clock.monotonic()
    ran_at: dict[str, float] = {}
    for n in range(round(seconds / READ_S)):
        clock.sleep(READ_S)
        meter.read([0], wait_s=0.0)
        if n + 1 == round((seconds - WINDOW_S) / READ_S):
            gpu.sync()
            ran_at = {name: gpu.containers[name].process.ctx.ran for name in patterns}
    gpu.sync()
    end = meter.gpus[0].last_stamp_s
    assert end is not None and ran_at
    truth = {
        name: 100 * (gpu.containers[name].process.ctx.ran - ran_at[name]) / WINDOW_S for name in patterns
    }
    window = WINDOW_S - (start + seconds - end)  # the reading runs to the newest device sample
    reading = {name: meter.used(0, keys[name], window) or 0.0 for name in patterns}
    return reading, truth, meter.gpus[0].book.corrections


@pytest.mark.parametrize("period", [1 / 6, 0.5, 1.0])
def test_a_busy_and_a_thin_container_running_together_are_each_read_within_5_points(period: float) -> None:
    # Both thawed all along: the record would split their busy time evenly (both "could
    # have run"), and summed credits favour the one resident more often (off by 12-17 pp).
    patterns = {
        "busy": PatternSpec("train", kernel_ms=3.0),
        "thin": PatternSpec("train", kernel_ms=3.0, busy=0.3),
    }
    reading, truth, corrections = free_run(patterns, period)
    assert corrections > 0
    assert truth["busy"] > 2 * truth["thin"] > 30  # the case: unequal, both substantial
    for name in patterns:
        assert reading[name] == pytest.approx(truth[name], abs=5.0), (name, reading, truth)


def test_two_windows_in_one_pass_read_as_each_window_alone() -> None:
    clock = VirtualClock(1000.0)
    gpu = VirtualGpuNode(clock, [EngineConfig(sample_period_s=0.25, seed=5)])
    meter = TurnMeter(
        [0], gpu, gpu.owner_of, settings=TurnSettings(), clock=clock, report=lambda _g, _m: None
    )
    ref = gpu.add("a", 0, pattern_program(PatternSpec("train", kernel_ms=4.0, busy=0.6), WorkloadStats()))
    key = container_key(ref.pod_uid, ref.container_id)
    assert meter.used_over(0, key, (4.0, 1.0)) == (None, None)  # no device sample yet
    meter.gpus[0].attribution.record(clock.monotonic(), key, True)
    for _ in range(40):
        clock.sleep(READ_S)
        meter.read([0], wait_s=0.0)
    longer, shorter = meter.used_over(0, key, (4.0, 1.0))
    assert longer == meter.used(0, key, 4.0) and shorter == meter.used(0, key, 1.0)
    assert longer is not None and longer > 30
