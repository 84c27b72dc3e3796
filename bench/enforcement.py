"""Compute-cap accuracy on the simulated GPU: the real agent, real containers, real freezer.

For each scenario a fresh simulated node (``agent.emulators.enforcednode``) runs busy
workloads in real container cgroups; the agent caps them by its duty cycle. Each
container's utilization is read from its CPU time in 0.5 s windows for ``--seconds``
after the workloads start. Reported per container: the target, the mean after
``--settle`` seconds, p5/p95 of the windows, and the settling time (the first window after
which every window's mean stays within ±5 pp of the target... of the 2 s rolling mean).

    sudo .venv/bin/python bench/enforcement.py [--seconds 23] [--settle 3]

Last line: ``RESULT max_abs_error_pp=... max_settle_s=...``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.domain.annotations import POLICY
from agent.emulators.containers import RunningContainer
from agent.emulators.enforcednode import cpu_seconds, enforced_node

WINDOW_S = 0.5
SETTLE_BAND_PP = 5.0


@dataclass(frozen=True)
class Box:
    name: str
    cores: int
    policy: str
    target: float  # what the container should get once settled


SCENARIOS: list[tuple[str, list[Box]]] = [
    ("fixed 30 alone", [Box("a", 30, "fixed-share", 30)]),
    ("fixed 50 alone", [Box("a", 50, "fixed-share", 50)]),
    ("fixed 80 alone", [Box("a", 80, "fixed-share", 80)]),
    ("fixed 30 + fixed 60", [Box("a", 30, "fixed-share", 30), Box("b", 60, "fixed-share", 60)]),
    ("burst 30 alone", [Box("a", 30, "burst-share", 100)]),
    ("burst 30 + burst 50", [Box("a", 30, "burst-share", 30), Box("b", 50, "burst-share", 50)]),
    ("fixed 40 + best-effort 30", [Box("a", 40, "fixed-share", 40), Box("b", 30, "best-effort", 60)]),
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def sample(boxes: list[RunningContainer], seconds: float) -> list[list[float]]:
    """Per container, its utilization in each WINDOW_S window."""
    series: list[list[float]] = [[] for _ in boxes]
    last = [cpu_seconds(b.pid) for b in boxes]
    last_t = time.monotonic()
    end = last_t + seconds
    stop = threading.Event()
    while time.monotonic() < end:
        stop.wait(WINDOW_S)
        now = [cpu_seconds(b.pid) for b in boxes]
        now_t = time.monotonic()
        for i, (a, b) in enumerate(zip(last, now, strict=True)):
            series[i].append(100 * (b - a) / (now_t - last_t))
        last, last_t = now, now_t
    return series


def settle_time(windows: list[float], target: float) -> float:
    """Seconds until the 2 s rolling mean enters ±SETTLE_BAND_PP of the target for good."""
    span = int(2 / WINDOW_S)
    rolling = [statistics.fmean(windows[max(0, i - span + 1) : i + 1]) for i in range(len(windows))]
    settled_at = len(rolling)
    for i in range(len(rolling) - 1, -1, -1):
        if abs(rolling[i] - target) > SETTLE_BAND_PP:
            break
        settled_at = i
    return (settled_at + 1) * WINDOW_S


@dataclass(frozen=True)
class Outcome:
    row: str
    error_pp: float
    settle_s: float


def run_scenario(name: str, boxes: list[Box], seconds: float, settle: float, workdir: Path) -> list[Outcome]:
    with enforced_node(workdir, agent_args=("--log-level", "WARNING", "--device-guard", "off")) as node:
        running = [node.run_pod(f"pod-{b.name}", b.cores, annotations={POLICY: b.policy}) for b in boxes]
        series = sample(running, seconds)
    return outcomes(name, boxes, series, settle)


def outcomes(name: str, boxes: list[Box], series: list[list[float]], settle: float) -> list[Outcome]:
    """One table row per container from its utilization windows."""
    rows = []
    skip = int(settle / WINDOW_S)
    for box, windows in zip(boxes, series, strict=True):
        after = windows[skip:]
        mean = statistics.fmean(after)
        settled = settle_time(windows, box.target)
        row = (
            f"| {name} | {box.name}: {box.policy} {box.cores} | {box.target:.0f} | {mean:.1f} | "
            f"{percentile(after, 5):.1f} | {percentile(after, 95):.1f} | {mean - box.target:+.1f} | "
            f"{settled:.1f} |"
        )
        rows.append(Outcome(row, abs(mean - box.target), settled))
    return rows


ScenarioRunner = Callable[[str, list[Box], float, float, Path], list[Outcome]]


def run_all(run: ScenarioRunner, description: str | None) -> int:
    """Parse --seconds/--settle, run every scenario with ``run``, print the table and RESULT."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=23.0, help="measured per scenario (default 23)")
    parser.add_argument("--settle", type=float, default=3.0, help="left out of the mean (default 3)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-enf-", dir="/tmp"))
    print("| scenario | container | target % | mean % | p5 % | p95 % | error pp | settle s |")
    print("|---|---|---|---|---|---|---|---|")
    errors: list[float] = []
    settles: list[float] = []
    try:
        for i, (name, boxes) in enumerate(SCENARIOS):
            for outcome in run(name, boxes, args.seconds, args.settle, workdir / str(i)):
                print(outcome.row, flush=True)
                errors.append(outcome.error_pp)
                settles.append(outcome.settle_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"RESULT max_abs_error_pp={max(errors):.1f} max_settle_s={max(settles):.1f}")
    return 0


def main() -> int:
    return run_all(run_scenario, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
