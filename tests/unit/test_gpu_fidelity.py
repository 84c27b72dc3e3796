"""The simulated GPU against what lent GPUs recorded (bench/gpu_replay.py): every recorded
table and trace under tests/data/gpu-traces/ is replayed on the engine in virtual time.

Until a raw trace from ``bench/gpu_suite.py`` exists, the reference is the H100 enforcement
table (docs/benchmarks.md): the old controller (duty cycles on NVML's per-process samples,
``--control-feedback nvml``) on a PyTorch matmul loop. The engine's driver-like NVML view must
reproduce it within ±5 pp of what was recorded (the range over the lent GPUs that ran the
scenario), but for the cells listed in ``KNOWN`` (docs/gpu-model.md says why), which must stay
within their bound so that they cannot drift unnoticed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from agent.clock import VirtualClock
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

ROOT = Path(__file__).resolve().parents[2]

# (scenario, container, figure) -> the most the engine may be off, and why it is off at all.
KNOWN = {
    ("fixed 30 alone", "a: fixed-share 30", "throughput"): 9.0,  # engine 59, H100 66: the failure, milder
    ("fixed 60 alone", "a: fixed-share 60", "throughput"): 10.0,  # engine 86, H100 78
    ("fixed 40 + best-effort 30", "b: best-effort 30", "nvml"): 11.0,  # the recorded pairs show the
    ("fixed 40 + best-effort 30", "b: best-effort 30", "throughput"): 10.0,  # held one frozen more often
}


def _replay() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("gpu_replay", ROOT / "bench" / "gpu_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_replay"] = module
    spec.loader.exec_module(module)
    return module


replay = _replay()
TABLES, TRACES = replay.references()


def test_there_is_a_recording_to_compare_with() -> None:
    assert TABLES, "no recorded GPU table under tests/data/gpu-traces/"


@pytest.fixture(scope="module", params=TABLES, ids=lambda p: p.parent.name)
def table_cells(request: pytest.FixtureRequest) -> list[Any]:
    table = replay.load_table(request.param)
    return list(replay.replay_table(table, EngineConfig(), seeds=(0, 1, 2), feedback="nvml"))


def test_the_engine_reproduces_each_recorded_table(table_cells: list[Any]) -> None:
    misses = []
    for cell in table_cells:
        bound = KNOWN.get((cell.scenario, cell.container, cell.what), replay.TOLERANCE_PP)
        if abs(cell.diff) > bound:
            misses.append(
                f"{cell.scenario} / {cell.container} / {cell.what}: engine {cell.engine:.1f}, "
                f"recorded {cell.recorded}, off by {cell.diff:+.1f} pp (allowed {bound})"
            )
    assert not misses, "\n".join(misses)
    within = sum(1 for c in table_cells if abs(c.diff) <= replay.TOLERANCE_PP)
    assert within >= len(table_cells) - len(KNOWN)


def test_the_old_controller_fails_on_the_engine_as_it_failed_on_the_gpu(table_cells: list[Any]) -> None:
    """The point of the driver-like view: a fixed 30 alone, held by NVML's per-process
    samples, ran at 66 % of the GPU's throughput on the H100; the exact view said 30."""
    cell = next(c for c in table_cells if c.scenario == "fixed 30 alone" and c.what == "throughput")
    assert cell.engine > 45
    exact = replay.load_table(TABLES[0])
    scenario = next(s for s in exact.scenarios if s.name == "fixed 30 alone")
    _nvml, throughput = replay.run_table_scenario(
        exact, scenario, EngineConfig.ideal(), seed=0, feedback="nvml"
    )
    assert throughput[0] < 35  # the ideal engine held it: that was the optimism


NO_TRACE = pytest.param(
    None,
    marks=pytest.mark.skip(
        reason="no raw trace recorded yet (bench/gpu_suite.py on a lent GPU); the table stands in"
    ),
)


@pytest.mark.parametrize(
    "path", TRACES or [NO_TRACE], ids=lambda p: f"{p.parent.name}/{p.name}" if p else "none"
)
def test_the_engine_reproduces_each_recorded_trace(path: Path) -> None:
    misses = [c for c in replay.compare_trace(path, EngineConfig()) if abs(c.diff) > replay.TOLERANCE_PP]
    assert not misses, "\n".join(
        f"{c.scenario} {c.container} {c.what}: {c.engine:.1f} vs {c.recorded}" for c in misses
    )


def _engine_trace(path: Path, config: EngineConfig) -> None:
    """A trace in the suite's schema recorded on the engine itself (its 'GPU' is the engine):
    two loops, A alone, A held to a duty of 0.3 at a 1 s cycle, both, disjoint slots."""
    clock = VirtualClock(start=0.0)
    gpu = VirtualGpuNode(clock, [config])
    loop = PatternSpec("train", kernels=1, kernel_ms=4.0)
    for who in ("A", "B"):
        gpu.add(who, 0, pattern_program(loop, WorkloadStats()))
    pids = {who: gpu.containers[who].process.pid for who in ("A", "B")}
    records: list[dict[str, object]] = []
    done = {"A": 0.0, "B": 0.0}
    since = 0

    class Key:
        def __init__(self, who: str) -> None:
            self.key = gpu.containers[who].ref.container_id

    def act(who: str, thaw: bool) -> None:
        (gpu.thaw if thaw else gpu.freeze)(Key(who))
        records.append(
            {
                "t": "act",
                "w": clock.monotonic(),
                "who": who,
                "op": "thaw" if thaw else "freeze",
                "frozen_w": None if thaw else clock.monotonic(),
            }
        )

    def tick(until: float, plan: dict[str, tuple[float, float]]) -> None:
        nonlocal since
        while clock.monotonic() < until - 1e-9:
            t = clock.monotonic()
            for who, (duty, offset) in plan.items():
                phase = (t - offset) % 1.0
                want = phase < duty
                if want == gpu.frozen(who):
                    act(who, want)
            clock.sleep(0.1)
            samples = gpu.process_samples(0, since)
            if samples:
                since = max(s.timestamp_us for s in samples)
            records.append(
                {
                    "t": "proc",
                    "w": clock.monotonic(),
                    "since": since,
                    "samples": [[s.pid, s.timestamp_us, s.sm_util, 0] for s in samples],
                }
            )
            for who in ("A", "B"):
                ran, stamps = gpu.gpu_seconds(who), []
                while ran - done[who] >= 0.004:
                    done[who] += 0.004
                    stamps.append(clock.monotonic())
                if stamps:
                    records.append({"t": "steps", "who": who, "w": stamps})

    segments = [
        ("A alone", {"A": (1.0, 0.0), "B": (0.0, 0.0)}),
        ("A duty 0.3", {"A": (0.3, 0.0), "B": (0.0, 0.0)}),
        ("both", {"A": (1.0, 0.0), "B": (1.0, 0.0)}),
        ("slots", {"A": (0.3, 0.0), "B": (0.6, 0.4)}),
    ]
    for name, plan in segments:
        start = clock.monotonic()
        tick(start + 4.0, plan)
        records.append({"t": "segment", "name": name, "start": start, "end": clock.monotonic(), "plan": {}})
    records.insert(
        0,
        {
            "t": "meta",
            "pattern": "train",
            "gpu": "engine",
            "driver": "-",
            "workers": pids,
            "alone_steps_per_s": 250.0,
            "sample_calls_s": 0.1,
            "schema": 1,
            "simulated": True,
        },
    )
    records.append({"t": "end", "w": clock.monotonic()})
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_a_trace_replays_to_its_own_figures(tmp_path: Path) -> None:
    """The replay itself: a trace recorded on the engine replays on the same engine to the same
    figures (schedule, loop and NVML reads as recorded), and to other figures on the exact view."""
    path = tmp_path / "trace-train.jsonl.gz"
    _engine_trace(path, EngineConfig())
    cells = replay.compare_trace(path, EngineConfig())
    assert len(cells) == 4 * 2 * 2
    assert max(abs(c.diff) for c in cells if c.what == "throughput") < 3
    assert max(abs(c.diff) for c in cells if c.what == "nvml") < 6
    alone = next(
        c for c in cells if c.scenario == "train A alone" and c.container == "A" and c.what == "throughput"
    )
    held = next(
        c for c in cells if c.scenario == "train A duty 0.3" and c.container == "A" and c.what == "throughput"
    )
    assert alone.recorded[0] > 90 and 25 < held.recorded[0] < 40
    exact = replay.compare_trace(path, EngineConfig.ideal())
    assert max(abs(c.diff) for c in exact if c.what == "nvml") > 10  # the views differ: the test can fail
