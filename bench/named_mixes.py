"""Mixes that were seen to fail, each run as ``bench/scenarios.py`` runs a random one, in
virtual time.

Each case is one GPU, its device sample period and 2-3 containers for two phases of
``--seconds``/2 (nothing changes at the half). It is scored like a random mix
(bench/scenario_score.py): what each container got, by the engine's truth, against what it
should get (fixed-share ``min(cap, use alone)``, best-effort the rest, water-filled), over
the second phase less ``--settle``. The agent's own 10 s reading is compared with the truth
too. The cases:

- three GPU-bound training loops capped 40 / 20 / 30 with 12 / 5 / 2 ms kernels, 1 s samples
  (the 30 once got 2.2 % and stayed frozen 31.8 s);
- three loops busy 60 % of their own time, capped 45 / 20 / 30, 0.5 s samples (29 / 9 / 19 %
  with the GPU 43 % idle; a freezer cannot meet those caps: one at a time they need 158 % of
  the time, run together they time-slice evenly);
- a graph capped at 40 beside a training loop a third busy (55 % while the agent read 40);
- a fixed 50 beside a best-effort loop of 37 ms kernels (40 %);
- a job that pulses (0.3 s on, 1.2 s off) capped at 10 beside a fixed 50 (twice its cap per
  second on; the 50 at 55-57 %).

    .venv/bin/python bench/named_mixes.py [--seconds 40] [--settle 5] [--controllers turns]

Output: one line per container; last line ``RESULT worst_abs_pp=... worst_reading_pp=...
longest_freeze_s=...`` over every container of every case (the largest error against what it
should get, the largest mean error of the agent's reading, the longest freeze).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scenario_mixes import VIEW_WINDOW_S, Member, Mix, references, simulate
from scenario_score import score_mix
from scenarios import CONTROLLERS

from agent.platform.gpu.sim.programs import PatternSpec

CASES: dict[str, tuple[float, tuple[Member, ...]]] = {
    "trainers 40/20/30, 12/5/2 ms kernels, 1 s samples": (
        1.0,
        (
            Member("a", "train", PatternSpec("train", kernel_ms=12.0), "fixed-share", 40),
            Member("b", "train", PatternSpec("train", kernel_ms=5.0), "fixed-share", 20),
            Member("c", "train", PatternSpec("train", kernel_ms=2.0), "fixed-share", 30),
        ),
    ),
    "trainers busy 60 %, 45/20/30, 0.5 s samples": (
        0.5,
        (
            Member("a", "train", PatternSpec("train", busy=0.6), "fixed-share", 45),
            Member("b", "train", PatternSpec("train", busy=0.6), "fixed-share", 20),
            Member("c", "train", PatternSpec("train", busy=0.6), "fixed-share", 30),
        ),
    ),
    "graph 40 beside a trainer a third busy": (
        1 / 6,
        (
            Member("a", "graph", PatternSpec("graph"), "fixed-share", 40),
            Member("b", "train", PatternSpec("train", busy=0.33), "fixed-share", 50),
        ),
    ),
    "fixed 50 beside a best-effort of 37 ms kernels": (
        1 / 6,
        (
            Member("a", "train", PatternSpec("train"), "fixed-share", 50),
            Member("b", "train", PatternSpec("train", kernel_ms=37.0), "best-effort", 10),
        ),
    ),
    "a pulse capped at 10 beside a fixed 50": (
        1 / 6,
        (
            Member("a", "bursty", PatternSpec("bursty", on_s=0.3, off_s=1.2), "fixed-share", 10),
            Member("b", "train", PatternSpec("train"), "fixed-share", 50),
        ),
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=40.0, help="per case, two phases (default 40)")
    parser.add_argument("--settle", type=float, default=5.0, help="left out of the score (default 5)")
    parser.add_argument(
        "--controllers", default="turns", help=f"comma-separated, of {', '.join(CONTROLLERS)}"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.controllers.split(",") if n]
    unknown = [n for n in names if n not in CONTROLLERS]
    if unknown or not names:
        parser.error(f"--controllers: unknown {', '.join(unknown)}")
    if args.seconds / 2 <= args.settle + VIEW_WINDOW_S:
        parser.error("--seconds: each phase (half) must be longer than --settle and a 10 s reading")
    worst = reading_worst = longest = 0.0
    for title, (period, members) in CASES.items():
        mix = Mix(0, period, 0, members, args.seconds / 2, "none")
        refs = references(mix, args.settle)
        for name in names:
            trace = simulate(mix, mix.members, CONTROLLERS[name])
            print(f"{title} ({name}):")
            for r in score_mix(name, mix, refs, trace, args.settle).records:
                if r.phase != 1:
                    continue
                start, end = mix.window(1, args.settle)
                errors = [
                    value - trace.pct(n, until - VIEW_WINDOW_S, until)
                    for at, n, value, until in trace.readings
                    if n == r.name and start + VIEW_WINDOW_S <= at <= end
                ]
                read = sum(errors) / len(errors) if errors else 0.0
                worst, reading_worst = max(worst, abs(r.error)), max(reading_worst, abs(read))
                longest = max(longest, r.longest_freeze_s)
                print(
                    f"  {r.member:52s} should {r.expected:5.1f} got {r.got:5.1f} ({r.error:+5.1f} pp)"
                    f"  reading {read:+5.1f} pp  longest freeze {r.longest_freeze_s:.1f} s"
                )
    print(
        f"RESULT worst_abs_pp={worst:.1f} worst_reading_pp={reading_worst:.1f} longest_freeze_s={longest:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.modules.setdefault("named_mixes", sys.modules[__name__])
    sys.exit(main())
