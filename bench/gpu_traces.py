"""Characterization traces (bench/gpu_suite.py, stage ``traces``): per pattern, two workers A
and B, each in a cgroup of its own, under schedules the suite imposes itself with the
freezer, while NVML is read every 0.1 s and each worker's steps are timed. No agent runs:
the schedule is known exactly, so what NVML and the GPU did under it can be read off.

Segments (seconds at scale 1; a drain of 0.5 s with both frozen between two):

- ``A alone``: A unthrottled, B frozen (3 s); gives A's steps per second alone;
- ``A duty D cycle C``: A thawed D of each C s, B frozen (D 0.3 and 0.6; C 0.25 and 1 s: 4 s;
  C 2 s: 6 s);
- ``A and B``: both unthrottled (3 s);
- ``A and B slots``: cycle 1 s, A thawed [0, 0.3), B thawed [0.4, 1.0) (4 s).

Workers: the PyTorch programs of bench/gpu_workloads.py on a real GPU, warmed up, then
frozen, then let go (``--go``) so that neither has queued anything before its first segment;
``vcuda-agent sim-workload --progress`` on the simulated one, with kernels of about the real
lengths (coarser where the simulator's cost per call matters). The simulated workloads have
no go file: they run from their start until the first freeze, a few milliseconds, which for
``burn`` is enough to fill B's queue before ``A alone`` (the simulated traces test the suite;
the real ones are the data). The record format is in bench/gpu_recording.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_budget import Budget, Summary, attempt
from gpu_recording import OVERLAP_US, SAMPLE_S, SCHEMA, Plan, Sampler, Scheduler, Slot, TraceWriter, plan_json
from gpu_sources import Source
from gpu_workers import (
    CgroupFreezer,
    CgroupParent,
    Freezer,
    ProgressTail,
    SignalFreezer,
    Worker,
    start_worker,
    stop_workers,
    wait_ready,
)

BENCH = Path(__file__).resolve().parent
WHOS = ("A", "B")
GAP_S = 0.5
QUICK_SEGMENT_S, QUICK_GAP_S = 1.0, 0.25
MIN_SCALE = 0.35  # shorter than this and a 2 s cycle is not even once in its segment: skip instead
START_S = {"real": 40.0, "sim": 4.0}  # starting two workers (import torch, CUDA init, warm-up)
STOP_S = {"real": 6.0, "sim": 3.0}
READY_TIMEOUT_S = {"real": 150.0, "sim": 30.0}
# The simulated workloads, after the PyTorch programs' shapes (H100, fp32): train one ~3 ms
# matmul a step; infer 4 short ones back to back; burn 20 ms kernels in a full queue; graph 50.
SIM_ARGS = {
    "train": ("--pattern", "train", "--kernels", "1", "--kernel-ms", "4"),
    "infer": (
        "--pattern",
        "infer",
        "--kernels",
        "4",
        "--kernel-ms",
        "1",
        "--clients",
        "1",
        "--rate",
        "100000",
    ),
    "burn": ("--pattern", "burn", "--kernel-ms", "20"),
    "graph": ("--pattern", "graph", "--kernels", "50", "--kernel-ms", "0.35"),
}


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float
    plan: dict[str, Plan]


def segments(scale: float = 1.0, *, quick: bool = False) -> list[Segment]:
    """The schedule of one pattern (see the module docstring)."""
    out = [Segment("A alone", 3.0, {"A": "free", "B": "frozen"})]
    for cycle, seconds in ((0.25, 4.0), (1.0, 4.0), (2.0, 6.0)):
        for duty in (0.3, 0.6):
            out.append(
                Segment(f"A duty {duty:g} cycle {cycle:g}", seconds, {"A": Slot(duty, cycle), "B": "frozen"})
            )
    out.append(Segment("A and B", 3.0, {"A": "free", "B": "free"}))
    out.append(Segment("A and B slots", 4.0, {"A": Slot(0.3, 1.0), "B": Slot(0.6, 1.0, 0.4)}))
    length = (lambda s: QUICK_SEGMENT_S) if quick else (lambda s: s.seconds * scale)
    return [Segment(s.name, length(s), s.plan) for s in out]


def schedule_s(segs: list[Segment], gap_s: float) -> float:
    return sum(s.seconds for s in segs) + gap_s * (len(segs) - 1)


@dataclass
class TraceSetup:
    """What every pattern's recording shares."""

    source: Source
    out: Path
    workdir: Path
    v2_root: Path | None
    python: str
    env: dict[str, str]
    quick: bool = False
    worker_args: tuple[str, ...] = ()  # more options of gpu_workloads.py (the tests: --device cpu)
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "sim" if self.source.simulated else "real"

    def command(self, pattern: str, who: str) -> tuple[list[str], Path, Path | None]:
        """(command, progress file, ready file or None) of one worker."""
        progress = self.workdir / f"{pattern}-{who}.steps"
        if self.source.simulated:
            state = str(getattr(self.source, "state_dir", ""))
            cmd = [self.python, "-m", "agent", "sim-workload", "--sim-state-dir", state, "--gpu", "0"]
            return [*cmd, *SIM_ARGS[pattern], "--progress", str(progress)], progress, None
        ready = self.workdir / f"{pattern}-{who}.ready"
        go = self.workdir / f"{pattern}.go"
        cmd = [self.python, str(BENCH / "gpu_workloads.py"), pattern, str(progress)]
        return [*cmd, "--ready", str(ready), "--go", str(go), *self.worker_args], progress, ready


def run_traces(
    setup: TraceSetup, patterns: list[str], budget: Budget, summary: Summary, keep_s: float
) -> int:
    """Record each pattern that fits, leaving ``keep_s`` of the budget to later stages; the
    number of trace files written."""
    written = 0
    fixed = START_S[setup.mode] + STOP_S[setup.mode]
    gap = QUICK_GAP_S if setup.quick else GAP_S
    for i, pattern in enumerate(patterns):
        share = (budget.left() - keep_s) / (len(patterns) - i)
        scale = 1.0 if setup.quick else min(1.0, (share - fixed) / schedule_s(segments(), gap))
        segs = segments(max(scale, MIN_SCALE), quick=setup.quick)
        estimate = fixed + schedule_s(segs, gap)  # below MIN_SCALE: what it would need at least
        if MIN_SCALE <= scale < 1.0:
            budget.say(f"traces: {pattern}: segments shortened to {scale:.0%} to fit the budget")
        recording = PatternRecording(setup, pattern, segs, gap, budget, until_s=budget.elapsed() + share)
        done = attempt(f"traces/{pattern}", estimate, budget, summary, recording.run)
        if done is not None:
            written += 1
            summary.file(done)
    return written


class PatternRecording:
    """One pattern's trace (the module docstring): start the workers, hold them both frozen,
    impose the segments, and on every way out stop everything and write what was recorded."""

    def __init__(
        self,
        setup: TraceSetup,
        pattern: str,
        segs: list[Segment],
        gap_s: float,
        budget: Budget,
        *,
        until_s: float,
    ) -> None:
        self.setup, self.pattern, self.segs, self.gap_s = setup, pattern, segs, gap_s
        self.budget, self.until_s = budget, until_s
        self.path = setup.out / "traces" / f"trace-{pattern}.jsonl.gz"
        self.parent: CgroupParent | None = None
        self.workers: list[Worker] = []
        self.freezer: Freezer | None = None
        self.writer: TraceWriter | None = None
        self.sampler: Sampler | None = None
        self.scheduler: Scheduler | None = None
        self.current: tuple[Segment, float] | None = None  # the segment under way, its start
        self.outcome: dict[str, Any] = {"errors": []}

    def run(self) -> Path:
        self.setup.outcomes[self.pattern] = self.outcome
        try:
            self._start()
            self._segments()
        finally:
            self._finish()
        return self.path

    def _start(self) -> None:
        setup, say = self.setup, self.budget.say
        dirs: dict[str, Path | None] = dict.fromkeys(WHOS)
        if setup.v2_root is not None:
            try:
                self.parent = CgroupParent.create(setup.v2_root)
                dirs = {who: self.parent.child(who) for who in WHOS}
            except OSError as err:
                self.outcome["errors"].append(f"no cgroup under {setup.v2_root}: {err}; signals instead")
                dirs = dict.fromkeys(WHOS)
        env = dict(setup.env)
        if not setup.source.simulated:
            env["CUDA_VISIBLE_DEVICES"] = setup.source.gpu_uuid
        say(f"traces: {self.pattern}: starting workers A and B")
        for who in WHOS:
            cmd, progress, ready = setup.command(self.pattern, who)
            self.workers.append(
                start_worker(
                    who,
                    cmd,
                    workdir=setup.workdir,
                    cgroup=dirs[who],
                    env=env,
                    ready_file=ready,
                    progress=progress,
                )
            )
        wait_ready(self.workers, READY_TIMEOUT_S[setup.mode])
        cgroups = {who: d for who, d in dirs.items() if d is not None}
        pids = {w.who: w.pid for w in self.workers}
        self.freezer = CgroupFreezer(cgroups) if len(cgroups) == len(WHOS) else SignalFreezer(pids)
        self.outcome["freezer"] = self.freezer.kind
        self.writer = TraceWriter(self.path, self._meta(None))
        self.scheduler = Scheduler(self.freezer, self.writer, WHOS)
        for who in WHOS:  # both frozen until their first segment: nothing queued before it starts
            self.scheduler.apply(who, True)
        self.scheduler.settle()
        (setup.workdir / f"{self.pattern}.go").touch()
        tails = {w.who: ProgressTail(w.progress) for w in self.workers}
        self.sampler = Sampler(setup.source, self.writer, tails)
        self.sampler.start()
        self._fit()
        say(f"traces: {self.pattern}: workers ready, pids {pids['A']} and {pids['B']}")

    def _fit(self) -> None:
        """A start-up slower than planned shortens the segments, rather than eating the time of
        the patterns and stages after this one."""
        left = self.until_s - self.budget.elapsed() - STOP_S[self.setup.mode]
        need = schedule_s(self.segs, self.gap_s)
        if need > left and not self.setup.quick:
            factor = max(left - self.gap_s * (len(self.segs) - 1), 0.0) / sum(s.seconds for s in self.segs)
            factor = max(factor, 0.1)  # the workers run: a short trace is worth more than none
            self.segs = [Segment(s.name, s.seconds * factor, s.plan) for s in self.segs]
            self.budget.say(f"traces: {self.pattern}: slow start-up: segments shortened to {factor:.0%}")
        self.outcome["segment_s"] = [round(s.seconds, 3) for s in self.segs]

    def _segments(self) -> None:
        assert self.scheduler is not None and self.writer is not None
        for n, seg in enumerate(self.segs):
            if n:
                self.scheduler.hold({"A": "frozen", "B": "frozen"}, self.gap_s)  # the queues drain
            self.current = (seg, time.time())
            start, end = self.scheduler.hold(seg.plan, seg.seconds)
            self._segment_record(seg, start, end)
            self.current = None
        self.scheduler.settle()

    def _segment_record(self, seg: Segment, start: float, end: float) -> None:
        assert self.writer is not None
        self.writer.add(
            {"t": "segment", "name": seg.name, "start": start, "end": end, "plan": plan_json(seg.plan)}
        )

    def _finish(self) -> None:
        if self.writer is not None and self.current is not None:  # cut short inside a segment
            self._segment_record(self.current[0], self.current[1], time.time())
        if self.sampler is not None:
            self.sampler.stop.set()
            self.sampler.join(timeout=5)
        stop_workers(self.workers, self.freezer)
        if self.parent is not None:
            self.outcome["errors"].extend(self.parent.remove())
        if self.writer is None or self.sampler is None:
            return
        self.sampler.read_steps()  # what the workers flushed on their way out
        self.outcome["nvml_errors"] = self.sampler.errors
        self.writer.add({"t": "end", "w": time.time()})
        alone = alone_rate(self.writer.records(), self.sampler.steps)
        self.writer.close(self._meta(alone))
        self.outcome["alone_steps_per_s"] = alone
        if self.scheduler is not None and self.scheduler.freeze_delays:
            self.outcome["freeze_landed_ms_median"] = 1000 * statistics.median(self.scheduler.freeze_delays)
        pids = {w.who: w.pid for w in self.workers}
        self.outcome["figures"] = figures(self.writer.records(), self.sampler.steps, alone, pids)
        _print_figures(self.pattern, self.outcome, self.budget.say)

    def _meta(self, alone: float | None) -> dict[str, Any]:
        return {
            "t": "meta",
            "pattern": self.pattern,
            "gpu": self.setup.source.gpu_name,
            "driver": self.setup.source.driver,
            "workers": {w.who: w.pid for w in self.workers},
            "alone_steps_per_s": alone,
            "sample_calls_s": SAMPLE_S,
            "schema": SCHEMA,
            "simulated": self.setup.source.simulated,
        }


def _segment_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["t"] == "segment"]


def alone_rate(records: list[dict[str, Any]], steps: dict[str, list[float]]) -> float | None:
    """A's steps per second over the first segment with A free and B frozen."""
    for seg in _segment_records(records):
        if seg["plan"] == {"A": "free", "B": "frozen"} and seg["end"] > seg["start"]:
            start, end = float(seg["start"]), float(seg["end"])
            return sum(1 for t in steps.get("A", ()) if start < t <= end) / (end - start)
    return None


def figures(
    records: list[dict[str, Any]], steps: dict[str, list[float]], alone: float | None, pids: dict[str, int]
) -> list[dict[str, Any]]:
    """Per segment and worker: throughput (% of A alone) and the mean smUtil NVML credited
    it per incremental call; a digest for summary.json and the log, the trace has it all."""
    calls = [r for r in records if r["t"] == "proc" and r["since"] != round(r["w"] * 1e6) - OVERLAP_US]
    out = []
    for seg in _segment_records(records):
        span = seg["end"] - seg["start"]
        row: dict[str, Any] = {"segment": seg["name"], "seconds": round(span, 2)}
        inside = [c for c in calls if seg["start"] < c["w"] <= seg["end"]]
        for who, pid in pids.items():
            n = sum(1 for t in steps.get(who, ()) if seg["start"] < t <= seg["end"])
            row[f"{who}_pct"] = round(100 * n / span / alone, 1) if alone and span > 0 else None
            credit = [sum(s[2] for s in c["samples"] if s[0] == pid) for c in inside]
            row[f"{who}_nvml_sm"] = round(statistics.mean(credit), 1) if credit else None
        out.append(row)
    return out


def _print_figures(pattern: str, outcome: dict[str, Any], say: Any) -> None:
    alone = outcome.get("alone_steps_per_s")
    say(f"traces: {pattern}: A alone {alone or 0:.1f} steps/s; per segment: % of that | NVML smUtil a call")
    for row in outcome.get("figures", ()):
        say(
            f"  {row['segment']:<24} A {row['A_pct']!s:>6} % | {row['A_nvml_sm']!s:>5}   "
            f"B {row['B_pct']!s:>6} % | {row['B_nvml_sm']!s:>5}"
        )
