"""Fixed shares beside neighbours that keep the GPU only partly busy, in virtual time.

A fixed share that is not GPU-bound (a loop that thinks between steps: ``train`` at
``busy`` < 1, an open-loop inference server, a bursty job) is the ordinary case, and the
turns (:mod:`agent.control.turnloop`) give a held container the GPU *alone*: one whose
work keeps the GPU a fifth busy needs all the time for a fifth of it, and its unheld
neighbours, who yield to its turns, get what is left. This benchmark measures what each
container gets against what it should: ``min(cap, alone)``, where ``alone`` is its use
running alone, unthrottled (the GPU is never full in these scenarios, so every container
could have all of that). The controller is the agent's own ``Enforcer`` on the engine's
driver view (``bench/enforcement_model.py``), every scenario on a fresh GPU.

    .venv/bin/python bench/neighbours.py [--seconds 40] [--settle 10] [--sample-period S]

Last line: ``RESULT worst_short_pp=<largest shortfall of a container below what it
should get> worst_over_pp=<largest excess over its cap> longest_freeze_s=<longest a
container stayed frozen>``.
"""

from __future__ import annotations

import argparse
import sys

from enforcement_model import PERIOD_S, Box, box_spec, model_enforcer

from agent.clock import VirtualClock
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

P = PatternSpec
SCENARIOS: dict[str, list[tuple[int, PatternSpec]]] = {
    "20@busy0.20+40@busy0.20": [(20, P("train", busy=0.2)), (40, P("train", busy=0.2))],
    "20@busy0.25+40@busy0.20": [(20, P("train", busy=0.25)), (40, P("train", busy=0.2))],
    "20@busy0.30+40@busy0.20": [(20, P("train", busy=0.3)), (40, P("train", busy=0.2))],
    "20@busy0.50+40@busy0.20": [(20, P("train", busy=0.5)), (40, P("train", busy=0.2))],
    "30@infer100+50@busy0.30": [(30, P("infer", rate=100)), (50, P("train", busy=0.3))],
    "20@bursty+40@busy0.20": [(20, P("bursty")), (40, P("train", busy=0.2))],
    "30@graph+40@busy0.20": [(30, P("graph")), (40, P("train", busy=0.2))],
    "30@train+60@train": [(30, P("train")), (60, P("train"))],
}


def run(
    items: list[tuple[int, PatternSpec]], config: EngineConfig, seconds: float, settle: float
) -> tuple[list[float], list[float]]:
    """Each container's mean use (percent of the GPU) after ``settle``, and its longest freeze."""
    clock = VirtualClock()
    gpu = VirtualGpuNode(clock, [config])
    boxes = [
        Box(f"c{i}", cap, "fixed-share" if cap < 100 else "best-effort") for i, (cap, _p) in enumerate(items)
    ]
    specs = [box_spec(b) for b in boxes]
    enforcer = model_enforcer(gpu, lambda: specs, clock)
    for box, (_cap, pattern) in zip(boxes, items, strict=True):
        gpu.add(box.name, 0, pattern_program(pattern, WorkloadStats()))
    start = clock.monotonic()
    ran_at_settle: list[float] = []
    index = 0
    while clock.monotonic() - start < seconds - 1e-9:
        enforcer.period()
        index += 1
        clock.sleep(start + index * PERIOD_S - clock.monotonic())
        if not ran_at_settle and clock.monotonic() - start >= settle:
            ran_at_settle = [gpu.gpu_seconds(b.name) for b in boxes]
    enforcer.release_all()
    span = clock.monotonic() - start - settle
    used = [100 * (gpu.gpu_seconds(b.name) - r) / span for b, r in zip(boxes, ran_at_settle, strict=True)]
    return used, [gpu.longest_freeze(b.name) for b in boxes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument(
        "--sample-period", type=float, default=None, help="device sample period (engine default)"
    )
    args = parser.parse_args(argv)
    config = (
        EngineConfig() if args.sample_period is None else EngineConfig(sample_period_s=args.sample_period)
    )
    worst_short = worst_over = longest = 0.0
    for name, items in SCENARIOS.items():
        used, freezes = run(items, config, args.seconds, args.settle)
        cells = []
        for (cap, pattern), got in zip(items, used, strict=True):
            (alone,), _ = run([(100, pattern)], config, min(args.seconds, 20.0), min(args.settle, 5.0))
            should = min(cap, alone)
            worst_short = max(worst_short, should - got)
            worst_over = max(worst_over, got - cap)
            cells.append(f"cap {cap}: {got:5.1f} (should {should:5.1f})")
        longest = max(longest, *freezes)
        print(f"{name:26s} " + " | ".join(cells) + f" | longest freeze {max(freezes):4.1f} s", flush=True)
    print(
        f"RESULT worst_short_pp={worst_short:.1f} worst_over_pp={worst_over:.1f} "
        f"longest_freeze_s={longest:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
