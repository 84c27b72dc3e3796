"""How close the simulated GPU comes to a real one: recorded GPU runs replayed on the engine in
virtual time, side by side with what the hardware did.

Two kinds of record (``tests/data/gpu-traces/<gpu>-<driver>/``):

- ``enforcement-table.json``: an enforcement table recorded on a lent GPU (scenarios, the
  controller and workload that ran, NVML's view and each container's throughput per
  container). Each scenario is run again on the engine with the same controller
  (``--control-feedback nvml``: the duty cycles on NVML's per-process samples the table was
  recorded with), the same loop (one kernel and a sync per step, the step as long as the
  loop's alone-rate says), the same start-up order and the same yardsticks (the bench's own
  NVML estimator read every 0.5 s; steps over the loop alone).
- ``trace-<pattern>.jsonl.gz`` (``bench/gpu_suite.py``): raw data under schedules the suite
  imposed. The schedule (every freeze and thaw, at its time) is replayed on the engine with a
  loop of the recorded step length, NVML read at the recorded call times; per segment, each
  worker's NVML credit and its steps are compared.

    .venv/bin/python bench/gpu_replay.py [--reference PATH ...] [--seeds 0,1,2]
        [--feedback nvml|device] [--nvml-view driver|exact]

Last line: ``RESULT max_nvml_diff_pp=... max_throughput_diff_pp=... cells=N within_5pp=M``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from enforcement_model import Box, box_spec, model_enforcer
from gpu_recording import OVERLAP_US

from agent.clock import VirtualClock
from agent.domain.usage import GpuUsageEstimator
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu-traces"
PERIOD_S = 0.25
TOLERANCE_PP = 5.0


@dataclass(frozen=True)
class Scenario:
    name: str
    boxes: tuple[Box, ...]
    nvml: tuple[float, ...]  # recorded, per container
    throughput: tuple[float, ...]
    nvml_elsewhere: tuple[tuple[float, ...], ...] = ()  # the same scenario on other lent GPUs


@dataclass(frozen=True)
class Table:
    path: Path
    gpu: str
    driver: str
    kernel_ms: float
    seconds: float
    settle_s: float
    window_s: float
    stagger_s: float
    scenarios: tuple[Scenario, ...]


def load_table(path: Path) -> Table:
    raw = json.loads(path.read_text())
    others: dict[str, list[tuple[float, ...]]] = {}
    for run in raw.get("other_runs", ()):
        for name, values in run.get("nvml", {}).items():
            others.setdefault(name, []).append(tuple(float(v) for v in values))
    scenarios = tuple(
        Scenario(
            s["name"],
            tuple(Box(str(n), int(c), str(p)) for n, c, p in s["boxes"]),
            tuple(float(v) for v in s["nvml"]),
            tuple(float(v) for v in s["throughput"]),
            tuple(others.get(s["name"], ())),
        )
        for s in raw["scenarios"]
    )
    measure = raw["measure"]
    return Table(
        path,
        raw["gpu"],
        raw["driver"],
        float(raw["workload"]["kernel_ms"]),
        float(measure["seconds"]),
        float(measure["settle_s"]),
        float(measure["window_s"]),
        float(measure["stagger_s"]),
        scenarios,
    )


@dataclass(frozen=True)
class Cell:
    """One figure of one container: the engine's mean against what was recorded."""

    scenario: str
    container: str
    what: str  # "nvml" | "throughput"
    engine: float
    recorded: tuple[float, ...]  # every lent GPU's figure

    @property
    def diff(self) -> float:
        """How far the engine is from the recorded figures (0 inside their range)."""
        lo, hi = min(self.recorded), max(self.recorded)
        return (
            0.0 if lo <= self.engine <= hi else (self.engine - hi if self.engine > hi else self.engine - lo)
        )


def run_table_scenario(
    table: Table, scenario: Scenario, config: EngineConfig, *, seed: int, feedback: str
) -> tuple[list[float], list[float]]:
    """One scenario on the engine: (NVML's view, throughput) per container, each the mean of
    0.5 s windows after the settling time, as the recorded bench measured them."""
    clock = VirtualClock()
    gpu = VirtualGpuNode(clock, [dataclasses.replace(config, seed=seed)])
    specs: list[Any] = []
    enforcer = model_enforcer(gpu, lambda: specs, clock, feedback=feedback)
    loop = PatternSpec("train", kernels=1, kernel_ms=table.kernel_ms, seed=seed)
    start, periods = clock.monotonic(), 0

    def run_until(t: float) -> None:
        nonlocal periods
        while clock.monotonic() < t - 1e-9:
            enforcer.period()
            periods += 1
            clock.sleep(start + periods * PERIOD_S - clock.monotonic())

    for n, box in enumerate(scenario.boxes):
        if n:  # the next container's process starts while the first already runs
            run_until(clock.monotonic() + table.stagger_s)
        specs.append(box_spec(box))
        gpu.add(box.name, 0, pattern_program(loop, WorkloadStats()))
    alone = _alone_rate(config, loop)
    estimator = GpuUsageEstimator[int](window_s=table.window_s)  # the recorded bench's reader
    pids = [gpu.containers[b.name].process.pid for b in scenario.boxes]
    since, last = 0, [gpu.gpu_seconds(b.name) for b in scenario.boxes]
    nvml: list[list[float]] = [[] for _ in pids]
    work: list[list[float]] = [[] for _ in pids]
    end = clock.monotonic() + table.seconds
    while clock.monotonic() < end - 1e-9:
        window_start = clock.monotonic()
        run_until(window_start + table.window_s)
        samples = gpu.process_samples(0, since)
        if samples:
            since = max(s.timestamp_us for s in samples)
        estimator.add_samples((s.pid, s.pid, s.timestamp_us, float(s.sm_util)) for s in samples)
        estimate = estimator.estimate(clock.wall())
        ran = [gpu.gpu_seconds(b.name) for b in scenario.boxes]
        for i, pid in enumerate(pids):
            nvml[i].append(estimate.by_key.get(pid, 0.0))
            work[i].append(100 * (ran[i] - last[i]) / (clock.monotonic() - window_start) / alone)
        last = ran
    skip = int(table.settle_s / table.window_s)
    return [statistics.mean(x[skip:]) for x in nvml], [statistics.mean(x[skip:]) for x in work]


def _alone_rate(config: EngineConfig, loop: PatternSpec) -> float:
    """GPU seconds per second the loop does alone on the whole engine (its 100 %)."""
    clock = VirtualClock()
    gpu = VirtualGpuNode(clock, [config])
    gpu.add("x", 0, pattern_program(loop, WorkloadStats()))
    clock.sleep(1.0)
    before = gpu.gpu_seconds("x")
    clock.sleep(5.0)
    return (gpu.gpu_seconds("x") - before) / 5.0


def replay_table(
    table: Table, config: EngineConfig, seeds: Sequence[int] = (0, 1, 2), feedback: str = "nvml"
) -> list[Cell]:
    cells = []
    for scenario in table.scenarios:
        runs = [run_table_scenario(table, scenario, config, seed=s, feedback=feedback) for s in seeds]
        for i, box in enumerate(scenario.boxes):
            label = f"{box.name}: {box.policy} {box.cores}"
            nvml = statistics.mean(r[0][i] for r in runs)
            thr = statistics.mean(r[1][i] for r in runs)
            recorded_nvml = (scenario.nvml[i], *(other[i] for other in scenario.nvml_elsewhere))
            cells.append(Cell(scenario.name, label, "nvml", nvml, recorded_nvml))
            cells.append(Cell(scenario.name, label, "throughput", thr, (scenario.throughput[i],)))
    return cells


# Traces ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    name: str
    start: float
    end: float


@dataclass
class Trace:
    """The raw record of one pattern's characterization run (bench/gpu_suite.py)."""

    pattern: str
    step_s: float  # the loop's step alone on the whole GPU
    segments: list[Segment]
    acts: list[tuple[float, str, bool]]  # (wall s, worker, thawed?)
    calls: list[float]  # wall times of the incremental nvmlDeviceGetProcessUtilization calls
    proc: list[tuple[float, dict[int, float]]]  # per call: smUtil credited per pid
    steps: dict[str, list[float]]  # per worker, step completion times
    pids: dict[str, int]


def load_trace(path: Path) -> Trace:
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    meta = next(r for r in records if r["t"] == "meta")
    rate = meta.get("alone_steps_per_s") or 0.0
    segments = [
        Segment(r["name"], float(r["start"]), float(r["end"])) for r in records if r["t"] == "segment"
    ]
    acts = [(float(r["w"]), str(r["who"]), r["op"] == "thaw") for r in records if r["t"] == "act"]
    proc = []
    for r in records:
        # The suite also asks for the last 2 s now and then (how NVML answers an overlapping
        # ``since``): those calls are not part of the incremental series the agent reads.
        if r["t"] == "proc" and int(r["since"]) != round(float(r["w"]) * 1e6) - OVERLAP_US:
            credit: dict[int, float] = {}
            for pid, _ts, sm, *_ in r["samples"]:
                credit[int(pid)] = credit.get(int(pid), 0.0) + float(sm)
            proc.append((float(r["w"]), credit))
    steps: dict[str, list[float]] = {}
    for r in records:
        if r["t"] == "steps":
            steps.setdefault(str(r["who"]), []).extend(float(w) for w in r["w"])
    return Trace(
        str(meta["pattern"]),
        1.0 / rate if rate > 0 else 0.0,
        segments,
        sorted(acts),
        [w for w, _ in proc],
        proc,
        {k: sorted(v) for k, v in steps.items()},
        {str(k): int(v) for k, v in meta["workers"].items()},
    )


def segment_figures(trace: Trace, segment: Segment) -> dict[str, tuple[float, float]]:
    """Per worker over a segment: (NVML credit per call, mean over the segment's calls;
    throughput, percent of the loop alone)."""
    calls = [credit for w, credit in trace.proc if segment.start < w <= segment.end]
    span = segment.end - segment.start
    out = {}
    for who, pid in trace.pids.items():
        nvml = statistics.mean(c.get(pid, 0.0) for c in calls) if calls else 0.0
        n = sum(1 for t in trace.steps.get(who, ()) if segment.start < t <= segment.end)
        thr = 100 * n * trace.step_s / span if span > 0 and trace.step_s > 0 else 0.0
        out[who] = (nvml, thr)
    return out


def replay_trace(trace: Trace, config: EngineConfig) -> Trace:
    """The trace's schedule on the engine: the same loop (one kernel a step, the recorded
    step), the same freezes and thaws at the same times, NVML read at the same calls. Returns
    the engine's trace in the same form (so ``segment_figures`` reads both alike)."""
    clock = VirtualClock()
    t0 = min([trace.acts[0][0]] if trace.acts else [] + [s.start for s in trace.segments])
    gpu = VirtualGpuNode(clock, [config])
    loop = PatternSpec("train", kernels=1, kernel_ms=max(trace.step_s, 1e-5) * 1000)
    stats: dict[str, WorkloadStats] = {}
    for who in sorted(trace.pids):
        stats[who] = WorkloadStats()
        gpu.add(who, 0, pattern_program(loop, stats[who]))
    begin = clock.monotonic()
    pids = {who: gpu.containers[who].process.pid for who in trace.pids}
    events = sorted(
        [(w, "act", (who, thaw)) for w, who, thaw in trace.acts] + [(w, "call", None) for w in trace.calls]
    )
    since, proc = 0, []
    steps: dict[str, list[float]] = {who: [] for who in trace.pids}
    done = {who: 0.0 for who in trace.pids}
    for w, kind, payload in events:
        clock.sleep(max(0.0, begin + (w - t0) - clock.monotonic()))
        for who in trace.pids:  # a step completes per step_s of GPU work done
            ran = gpu.gpu_seconds(who)
            while trace.step_s > 0 and ran - done[who] >= trace.step_s:
                done[who] += trace.step_s
                steps[who].append(w)
        if kind == "act":
            who, thaw = payload  # type: ignore[misc]
            target = _Key(gpu.containers[who].ref.container_id)
            (gpu.thaw if thaw else gpu.freeze)(target)
        else:
            samples = gpu.process_samples(0, since)
            if samples:
                since = max(s.timestamp_us for s in samples)
            credit: dict[int, float] = {}
            for s in samples:
                credit[s.pid] = credit.get(s.pid, 0.0) + s.sm_util
            proc.append((w, credit))
    return Trace(trace.pattern, trace.step_s, trace.segments, trace.acts, trace.calls, proc, steps, pids)


@dataclass(frozen=True)
class _Key:
    key: str


def compare_trace(path: Path, config: EngineConfig) -> list[Cell]:
    recorded = load_trace(path)
    engine = replay_trace(recorded, config)
    cells = []
    for segment in recorded.segments:
        real, sim = segment_figures(recorded, segment), segment_figures(engine, segment)
        for who in recorded.pids:
            cells.append(
                Cell(f"{recorded.pattern} {segment.name}", who, "nvml", sim[who][0], (real[who][0],))
            )
            cells.append(
                Cell(f"{recorded.pattern} {segment.name}", who, "throughput", sim[who][1], (real[who][1],))
            )
    return cells


def references(root: Path = TRACES) -> tuple[list[Path], list[Path]]:
    """(enforcement tables, traces) recorded on lent GPUs."""
    return sorted(root.glob("*/enforcement-table.json")), sorted(root.glob("*/trace-*.jsonl.gz"))


def print_cells(cells: Iterable[Cell]) -> None:
    print("| scenario | container | figure | engine | recorded | off by pp |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        recorded = " / ".join(f"{v:.1f}" for v in c.recorded)
        print(f"| {c.scenario} | {c.container} | {c.what} | {c.engine:.1f} | {recorded} | {c.diff:+.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reference", type=Path, action="append", help="a table or trace (default: all recorded)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="engine seeds averaged per scenario")
    parser.add_argument(
        "--feedback", choices=("nvml", "device"), default="nvml", help="the controller to replay"
    )
    parser.add_argument(
        "--nvml-view", choices=("driver", "exact"), default="driver", help="the engine's NVML view"
    )
    args = parser.parse_args(argv)
    config = EngineConfig(nvml_view=args.nvml_view)
    tables, traces = references()
    if args.reference:
        tables = [p for p in args.reference if p.name.endswith(".json")]
        traces = [p for p in args.reference if p.name.endswith(".jsonl.gz")]
    seeds = [int(s) for s in args.seeds.split(",")]
    cells: list[Cell] = []
    for path in tables:
        table = load_table(path)
        print(
            f"# {path.relative_to(path.parents[2])}: {table.gpu}, driver {table.driver}; "
            f"{args.feedback} feedback"
        )
        found = replay_table(table, config, seeds, args.feedback)
        print_cells(found)
        cells += found
    for path in traces:
        found = compare_trace(path, config)
        print(f"# {path.name}")
        print_cells(found)
        cells += found
    nvml = [abs(c.diff) for c in cells if c.what == "nvml"]
    thr = [abs(c.diff) for c in cells if c.what == "throughput"]
    within = sum(1 for c in cells if abs(c.diff) <= TOLERANCE_PP)
    print(
        f"RESULT max_nvml_diff_pp={max(nvml, default=0):.1f} "
        f"max_throughput_diff_pp={max(thr, default=0):.1f} "
        f"cells={len(cells)} within_5pp={within}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
