"""Every benchmark that runs on this machine, each run N times in a row, to show that each
reaches its ``RESULT`` line every time: a benchmark that dies gives no figure.

The runs are short (fewer rounds, shorter phases than the figures in docs/benchmarks.md
use): what is checked is that a run finishes, not its figures. A run fails when it exits
non-zero, when its last line is not ``RESULT ...``, or when it passes ``--timeout``; its
last lines are printed. Left out: the GPU script's benches (bench/gpu_*.py need a lent
GPU; ``gpu_replay.py``, which replays recorded traces on the engine, is in) and
``image.py`` (a clean image build, several minutes of downloads; ``--with-image`` adds it).

    sudo .venv/bin/python bench/repeat.py [--times 3] [--only allocate,footprint] [--with-image]

Last line: ``RESULT benches=B runs=R failed=F``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> its arguments (short runs of each)
BENCHES: dict[str, tuple[str, ...]] = {
    "allocate": ("allocate.py", "--rounds", "300"),
    "controller_cost": ("controller_cost.py", "--seconds", "5"),
    "dra": ("dra.py", "--claims", "200", "--rounds", "200"),
    "enforcement-model": ("enforcement.py", "--model", "--seconds", "10"),
    "enforcement": ("enforcement.py", "--pattern", "train,burn", "--seconds", "6", "--settle", "3"),
    "enforcement-mps": (
        "enforcement.py",
        "--pattern",
        "train,burn",
        "--seconds",
        "6",
        "--settle",
        "3",
        "--actuator",
        "mps",
    ),
    "extender": ("extender.py", "--rounds", "50"),
    "footprint": ("footprint.py", "--containers", "128", "--seconds", "8", "--settle", "5"),
    "guard_window": ("guard_window.py", "--rounds", "1", "--seconds", "1"),
    "ioctl_overhead": ("ioctl_overhead.py", "--rounds", "3", "--calls", "20000"),
    "metrics_auth": ("metrics_auth.py", "--rounds", "50"),
    "named_mixes": ("named_mixes.py", "--seconds", "32"),
    "neighbours": ("neighbours.py", "--seconds", "10", "--settle", "5"),
    "quota_overshoot": ("quota_overshoot.py", "--trials", "1", "--cpu-seconds", "2"),
    "restarts": ("restarts.py", "--rounds", "20"),
    "scenarios": ("scenarios.py", "--mixes", "4", "--seconds", "20"),
    "scrape": ("scrape.py", "--rounds", "20"),
    "gpu_replay": ("gpu_replay.py", "--seeds", "0"),
}
IMAGE = ("image.py",)


def run_once(args: tuple[str, ...], timeout_s: float) -> tuple[bool, float, str]:
    """(finished with a RESULT line, seconds, its last lines)."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / args[0]), *args[1:]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        out = (
            (err.stdout or b"").decode(errors="replace")
            if isinstance(err.stdout, bytes)
            else err.stdout or ""
        )
        return False, time.monotonic() - started, f"timed out after {timeout_s:.0f} s\n{out[-1500:]}"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    ok = done.returncode == 0 and bool(lines) and lines[-1].startswith("RESULT ")
    tail = "\n".join(lines[-3:]) if ok else f"exit {done.returncode}\n{(done.stdout + done.stderr)[-1500:]}"
    return ok, time.monotonic() - started, tail


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--times", type=int, default=3, help="runs of each, in a row (default 3)")
    parser.add_argument("--only", help="comma-separated names (default: all)")
    parser.add_argument("--with-image", action="store_true", help="the clean image build too")
    parser.add_argument("--timeout", type=float, default=900.0, help="one run's limit, s (default 900)")
    args = parser.parse_args()
    benches = dict(BENCHES)
    if args.with_image:
        benches["image"] = IMAGE
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in benches]
        if unknown:
            parser.error(f"unknown bench(es) {', '.join(unknown)}; known: {', '.join(benches)}")
        benches = {n: benches[n] for n in wanted}
    failed = 0
    for name, bench_args in benches.items():
        for attempt in range(1, args.times + 1):
            ok, seconds, tail = run_once(bench_args, args.timeout)
            failed += not ok
            result = tail.splitlines()[-1] if ok else "FAILED"
            print(f"{name} run {attempt}/{args.times}: {seconds:6.1f} s  {result}", flush=True)
            if not ok:
                print("    " + tail.replace("\n", "\n    "), flush=True)
    print(f"RESULT benches={len(benches)} runs={len(benches) * args.times} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
