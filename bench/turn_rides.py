"""Turn ends that ride on the loop's other wake-ups (``TurnSettings.ride_s``), on a whole
node in virtual time: with rides and without, side by side.

8 simulated GPUs (``agent.emulators.virtualgpu``) under one ``Enforcer`` on a virtual clock,
as the agent runs them. Two kinds of node:

- ``full``: the footprint benchmark's node, 16 fixed-share 6 % containers a GPU, one
  workload shape for all (train 20 x 2 ms, graph 50 x 1 ms, infer);
- ``mixed``: ``--mixes`` seeded random nodes: per GPU 4-16 fixed-share containers with caps
  of 3 up to their even split of 96, each a random pattern (train, graph, infer, bursty) with
  kernels of 1-20 ms, and a device sample period of 1/6, 0.25 or 0.5 s per GPU.

Per run: the loop's wake-ups a second (sleeps that ended), freezes a second, and each
container's use over ``--seconds`` after 20 s to settle against its cap: the highest, the
95th percentile and the mean shortfall.

    .venv/bin/python bench/turn_rides.py [--mixes 8] [--seed 0] [--seconds 60]

Each node runs three times: without rides, without rides with the loop started 1.3 ms later
(the noise floor: how much a figure moves when nothing but the loop's phase against the
device samples changes), and with rides.

Last line: ``RESULT full_wakeups=<no rides>/<shifted>/<rides> ... mixed_wakeups=...
mixed_max_over_pp=... mixed_p95_over_pp=... mixed_mean_under_pp=...`` (means over the runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import threading
from collections.abc import Sequence

from enforcement_model import PERIOD_S, Box, box_spec

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.domain.turns import TurnSettings
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

GPUS = 8
SETTLE_S = 20.0
# (turn settings, the loop's start after the engine's, s). The shifted run is the noise floor:
# the same controller, its periods 1.3 ms later against the device samples. On random nodes a
# figure such as the highest container's overshoot moves about as much from that alone.
VARIANTS = {
    "no rides": (TurnSettings(ride_s=0.0), 0.0),
    "no rides, shifted": (TurnSettings(ride_s=0.0), 0.0013),
    "rides": (TurnSettings(), 0.0),
}
FULL = {
    "train": PatternSpec("train", kernel_ms=2.0),
    "graph": PatternSpec("graph", kernel_ms=1.0),
    "infer": PatternSpec("infer"),
}


class _CountingClock(VirtualClock):
    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        if seconds > 0:
            self.wakeups += 1
        return super().sleep(seconds, stop)


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    gpu: int
    cap: int
    pattern: PatternSpec


@dataclasses.dataclass(frozen=True)
class Outcome:
    wakeups_per_s: float  # the loop's sleeps that ended
    freezes_per_s: float
    uses: dict[str, float]  # each container's use, percent of its GPU
    over: list[float]  # each container's use less its cap, pp, lowest first

    @property
    def max_over_pp(self) -> float:
        return self.over[-1]

    @property
    def p95_over_pp(self) -> float:
        return self.over[int(0.95 * (len(self.over) - 1))]

    @property
    def mean_under_pp(self) -> float:
        return sum(-min(0.0, o) for o in self.over) / len(self.over)


def full_node(pattern: PatternSpec) -> tuple[list[Member], list[float]]:
    members = [
        Member(f"g{g}c{i}", g, 6, dataclasses.replace(pattern, seed=g * 100 + i))
        for g in range(GPUS)
        for i in range(16)
    ]
    return members, [1 / 6] * GPUS


def mixed_node(seed: int, index: int) -> tuple[list[Member], list[float]]:
    rng = random.Random(f"{seed}:{index}")
    periods = [rng.choice([1 / 6, 0.25, 0.5]) for _ in range(GPUS)]
    members = []
    for g in range(GPUS):
        n = rng.randint(4, 16)
        for i in range(n):
            cap = rng.randint(3, max(3, 96 // n))
            kind = rng.choice(["train", "graph", "infer", "bursty"])
            pattern = PatternSpec(kind, kernel_ms=rng.uniform(1, 20), seed=rng.randint(0, 10**6))
            members.append(Member(f"g{g}c{i}", g, cap, pattern))
    return members, periods


def run(
    members: Sequence[Member],
    periods: Sequence[float],
    settings: TurnSettings,
    phase_s: float,
    seconds: float,
    *,
    settle_s: float = SETTLE_S,
) -> Outcome:
    """``members`` on 8 simulated GPUs (``periods``: their device sample periods) under one
    enforcer with ``settings``, started ``phase_s`` after the engine; ``settle_s`` to settle,
    then ``seconds`` measured."""
    clock = _CountingClock()
    node = VirtualGpuNode(clock, [EngineConfig(seed=g, sample_period_s=p) for g, p in enumerate(periods)])
    specs = []
    for m in members:
        specs.append(dataclasses.replace(box_spec(Box(m.name, m.cap, "fixed-share")), gpus=(m.gpu,)))
        node.add(m.name, m.gpu, pattern_program(m.pattern, WorkloadStats()))
    clock.sleep(phase_s)
    enforcer = Enforcer(
        gpus=list(range(GPUS)),
        samples=node,
        specs=lambda: specs,
        owner_of=node.owner_of,
        locate=lambda s: ThrottleTarget(s.container_id, None, None),
        actuator=node,
        period_s=PERIOD_S,
        clock=clock,
        turns=settings,
    )

    def run_for(span: float) -> None:
        start, index = clock.monotonic(), 0
        while clock.monotonic() - start < span - 1e-9:
            enforcer.period()
            index += 1
            clock.sleep(start + index * PERIOD_S - clock.monotonic())

    run_for(settle_s)
    ran = {m.name: node.gpu_seconds(m.name) for m in members}
    freezes = sum(c.freezes for c in enforcer.controls())
    wakeups, start = clock.wakeups, clock.monotonic()
    run_for(seconds)
    span = clock.monotonic() - start
    uses = {m.name: 100 * (node.gpu_seconds(m.name) - ran[m.name]) / span for m in members}
    return Outcome(
        (clock.wakeups - wakeups) / span,
        (sum(c.freezes for c in enforcer.controls()) - freezes) / span,
        uses,
        sorted(uses[m.name] - m.cap for m in members),
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mixes", type=int, default=8, help="random mixed nodes (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixed nodes (default 0)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured per run (default 60)")
    args = parser.parse_args(argv)
    if args.mixes < 1 or args.seconds < 10:
        parser.error("--mixes must be >= 1 and --seconds >= 10")
    logging.disable(logging.WARNING)  # caps that cannot be held by freezing say so per container
    print("| node | variant | wake-ups/s | freezes/s | max over cap pp | p95 over pp | mean under pp |")
    print("|---|---|---|---|---|---|---|")
    results: dict[tuple[str, str], list[Outcome]] = {}
    nodes = [(f"full {k}", *full_node(p)) for k, p in FULL.items()]
    nodes += [(f"mixed {args.seed}:{i}", *mixed_node(args.seed, i)) for i in range(args.mixes)]
    for label, members, periods in nodes:
        for variant, (settings, phase_s) in VARIANTS.items():
            o = run(members, periods, settings, phase_s, args.seconds)
            results.setdefault((label.split()[0], variant), []).append(o)
            print(
                f"| {label} | {variant} | {o.wakeups_per_s:.1f} | {o.freezes_per_s:.1f} "
                f"| {o.max_over_pp:+.2f} | {o.p95_over_pp:+.2f} | {o.mean_under_pp:.2f} |",
                flush=True,
            )
    parts = []
    for kind in ("full", "mixed"):
        for field in ("wakeups_per_s", "max_over_pp", "p95_over_pp", "mean_under_pp"):
            each = [f"{_mean([getattr(o, field) for o in results[(kind, v)]]):.2f}" for v in VARIANTS]
            parts.append(f"{kind}_{field.removesuffix('_per_s')}={'/'.join(each)}")
    print("RESULT " + " ".join(parts) + f" mixes={args.mixes} seed={args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
