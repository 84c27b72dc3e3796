"""Randomized benchmark of compute-cap controllers on one simulated GPU, in virtual time.

``--mixes`` seeded random mixes (bench/scenario_mixes.py: mix ``i`` of ``--seed S`` draws from
``random.Random(f"{S}:{i}")``): per mix a device sample period (1/6, 0.25, 0.5 or 1 s, unless
``--sample-period``), 2-4 containers, each with a pattern (train, infer open or closed loop,
graph, bursty; gpu_burn-like ``burn`` too with ``--deep-queues``), its own kernel length
(log-uniform 1-40 ms) and a policy (fixed-share, burst-share with or without a limit,
best-effort), their requests summing to at most 100; two phases of ``--seconds``/2, every
container but possibly one started at 0 and, at the half, one change (a container starts,
one stops, or none). Each controller of ``--controllers`` runs every mix, the same mixes.

Scored (bench/scenario_score.py), per container and phase over [phase start + ``--settle``,
phase end], by the engine's ground truth: what it got against what it should get, from its
use alone on the GPU (its own run, no controller) and, for best-effort, the GPU's capacity
with everything unthrottled (one more run): fixed-share min(cap, alone); burst-share
min(request, alone) while a neighbour is active (alone >= 5 %), else min(limit, alone);
best-effort the rest, water-filled. Figures: ``within3`` (pairs within 3 pp), ``p95_abs_pp``,
``max_over_pp`` and ``max_short_pp`` (fixed/burst against target and expected),
``longest_under_cap_freeze_s``, ``idle_while_short_pct``, ``view_p95_err_pp`` (the controller's
own 10 s reading against the truth) and ``settle_p95_s``.

    .venv/bin/python bench/scenarios.py [--seed S] [--mixes N] [--seconds 40] [--settle 5]
        [--sample-period P] [--deep-queues] [--controllers turns[,NAME...]] [--load MODULE]
        [--node-wakes N] [--table] [--json PATH]

``--node-wakes N``: the loop is also woken N times a second at seeded random instants, as a
full node's other GPUs wake it (8 GPUs of 16 held containers: about 70); ``turns-noride``
is the controller with no turn end moved onto such a wake-up (``TurnSettings.ride_s`` 0).

Output: with ``--table`` a markdown table per mix; a summary table per controller and sample
period; a table of the figures scored per pair (``within3``, ``p95_abs_pp``, ``max_over_pp``,
``max_short_pp``, ``longest_under_cap_freeze_s``, ``settle_p95_s``) by each phase's time one
at a time (bench/scenario_score.py:
up to 0.9 exclusive turns could give everyone what it should get, over 1.1 only running
together can), guaranteed and best-effort containers apart; last line ``RESULT within3=...
p95_abs_pp=... ... mixes=N seed=S`` (with several controllers each figure is prefixed with
the controller's name: ``turns_within3=...``).

A controller is a :class:`~scenario_mixes.ModelController` built by a factory
``(VirtualGpuNode, specs, VirtualClock) -> ModelController``; :func:`register` adds one (a
module named by ``--load`` may call it on import, or a script calls it and then :func:`main`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from enforcement_model import PERIOD_S, model_enforcer
from scenario_mixes import ControllerFactory, Mix, References, generate_mix, references
from scenario_mixes import simulate as simulate_mix
from scenario_score import FIGURES, PAIR_FIGURES, MixScore, by_one_at_a_time, figures, score_mix

from agent.clock import VirtualClock
from agent.control.enforcer import Enforcer
from agent.control.usagemeter import container_key
from agent.domain.specs import EnforcementSpec
from agent.domain.turns import TurnSettings
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import MAX_SAMPLE_PERIOD_S


class TurnsController:
    """The agent's controller: its ``Enforcer`` as ``model_enforcer`` builds it (turns on the
    device samples); its reading is its turn meter's. ``turns``: other turn settings to compare
    (``turns-yield``: unheld containers with a cap yield to held ones' turns, as before)."""

    def __init__(
        self,
        gpu: VirtualGpuNode,
        specs: Callable[[], list[EnforcementSpec]],
        clock: VirtualClock,
        turns: TurnSettings | None = None,
    ) -> None:
        self.enforcer: Enforcer = model_enforcer(gpu, specs, clock, turns=turns)

    def period(self) -> None:
        self.enforcer.period()

    def release_all(self) -> None:
        self.enforcer.release_all()

    def reading(self, spec: EnforcementSpec, window_s: float) -> tuple[float, float] | None:
        meter = self.enforcer.turns.meter
        end = meter.gpus[0].last_stamp_s
        used = meter.used(0, container_key(spec.pod_uid, spec.container_id), window_s)
        return None if used is None or end is None else (used, end)


CONTROLLERS: dict[str, ControllerFactory] = {
    "turns": TurnsController,
    "turns-yield": lambda gpu, specs, clock: TurnsController(
        gpu, specs, clock, TurnSettings(capped_yield=True)
    ),
    # No turn ends in a wake-up made for something else (as before TurnSettings.ride_s).
    "turns-noride": lambda gpu, specs, clock: TurnsController(gpu, specs, clock, TurnSettings(ride_s=0.0)),
}


class NodeWakes:
    """The wake-ups a full node's other GPUs give the loop: ``per_s`` a second at seeded
    random (Poisson) instants. One GPU's turns see what a crowded node's loop does, awake at
    any moment for another GPU's freeze or thaw (8 GPUs of 16 held containers: about 70 a
    second)."""

    def __init__(self, per_s: float, seed: str, start: float) -> None:
        self._rng = random.Random(seed)
        self._per_s = per_s
        self._next = start + self._rng.expovariate(per_s)

    def next_time(self, now: float) -> float:
        while self._next <= now:
            self._next += self._rng.expovariate(self._per_s)
        return self._next


def with_node_wakes(factory: ControllerFactory, per_s: float, seed: str) -> ControllerFactory:
    """``factory``'s controller, its turn loop also woken as :class:`NodeWakes` says."""
    if per_s <= 0:
        return factory

    def build(gpu: VirtualGpuNode, specs: Callable[[], list[EnforcementSpec]], clock: VirtualClock) -> Any:
        controller = factory(gpu, specs, clock)
        enforcer = getattr(controller, "enforcer", None)
        if isinstance(enforcer, Enforcer):
            loop, wakes = enforcer.turns, NodeWakes(per_s, seed, clock.monotonic())
            own = loop.next_time
            # The instance attribute shadows the method the enforcer's _act asks.
            loop.next_time = lambda: min(own(), wakes.next_time(clock.monotonic()))  # type: ignore[method-assign]
        return controller

    return build


def register(name: str, factory: ControllerFactory) -> None:
    """Make ``factory`` runnable as ``--controllers name``."""
    CONTROLLERS[name] = factory


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixes (default 0)")
    parser.add_argument("--mixes", type=int, default=40, help="how many mixes (default 40)")
    parser.add_argument("--seconds", type=float, default=40.0, help="per mix, two phases (default 40)")
    parser.add_argument(
        "--settle", type=float, default=5.0, help="left out of each phase's score (default 5)"
    )
    parser.add_argument("--sample-period", type=float, help="every mix's device sample period, s")
    parser.add_argument("--deep-queues", action="store_true", help="gpu_burn-like containers too")
    parser.add_argument("--controllers", default="turns", help="comma-separated (default turns)")
    parser.add_argument(
        "--node-wakes",
        type=float,
        default=0.0,
        help="the loop also wakes this often a second at random, as for a full node's other GPUs",
    )
    parser.add_argument(
        "--load", action="append", default=[], help="import this module first (it may register)"
    )
    parser.add_argument("--table", action="store_true", help="a table per mix")
    parser.add_argument("--json", type=Path, help="write every per-container record here")
    args = parser.parse_args(argv)
    for module in args.load:
        importlib.import_module(module)
    phase = args.seconds / 2
    if abs(phase / PERIOD_S - round(phase / PERIOD_S)) > 1e-9 or phase < 10 or phase <= args.settle:
        parser.error(
            f"--seconds: each phase (half) must be >= 10 s, over --settle and a multiple of {PERIOD_S} s"
        )
    if args.sample_period is not None and not 0.01 <= args.sample_period <= MAX_SAMPLE_PERIOD_S:
        parser.error(f"--sample-period must be 0.01..{MAX_SAMPLE_PERIOD_S:g} s")
    if args.mixes < 1:
        parser.error("--mixes must be >= 1")
    args.names = [n for n in args.controllers.split(",") if n]
    unknown = [n for n in args.names if n not in CONTROLLERS]
    if unknown or not args.names:
        parser.error(f"--controllers: unknown {', '.join(unknown)} (known: {', '.join(CONTROLLERS)})")
    return args


def mix_table(mix: Mix, refs: References, scores: dict[str, MixScore]) -> list[str]:
    names = list(scores)
    head = "| mix | sample s | change | container | phase | alone % | free % | expected % | "
    head += " | ".join(f"{n} got % | {n} err pp" for n in names) + " |"
    lines = [head, "|" + "---|" * (8 + 2 * len(names))]
    first = scores[names[0]].records
    for n, record in enumerate(first):
        cells = []
        for name in names:
            r = scores[name].records[n]
            cells += [f"{r.got:.1f}", f"{r.error:+.1f}"]
        lines.append(
            f"| {mix.index} | {mix.sample_period_s:.3g} | {mix.change} | {record.member} | {record.phase} | "
            f"{record.alone:.1f} | {refs.free[record.name, record.phase]:.1f} | {record.expected:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _fmt(key: str, value: float) -> str:
    return f"{value:.3f}" if key == "within3" else f"{value:.2f}"


def summary(scores: dict[str, list[MixScore]]) -> list[str]:
    lines = ["| controller | sample period s | mixes | " + " | ".join(FIGURES) + " |"]
    lines.append("|" + "---|" * (3 + len(FIGURES)))
    for name, per_mix in scores.items():
        periods = sorted({s.mix.sample_period_s for s in per_mix})
        groups = [(f"{p:.3g}", [s for s in per_mix if s.mix.sample_period_s == p]) for p in periods]
        for label, group in [*groups, ("all", per_mix)]:
            got = figures(group)
            lines.append(
                f"| {name} | {label} | {len(group)} | " + " | ".join(_fmt(k, got[k]) for k in FIGURES) + " |"
            )
    return lines


def one_at_a_time_table(scores: dict[str, list[MixScore]]) -> list[str]:
    """The pair figures by the phase's time one at a time (bench/scenario_score.py): up to 0.9
    exclusive turns could give everyone what it should get; over 1.1 only running together can.
    ``max_over_pp`` and ``max_short_pp`` are for guaranteed shares only ("-" for best-effort)."""
    lines = ["| controller | time one at a time | containers | pairs | " + " | ".join(PAIR_FIGURES) + " |"]
    lines.append("|" + "---|" * (4 + len(PAIR_FIGURES)))
    guaranteed_only = ("max_over_pp", "max_short_pp")
    for name, per_mix in scores.items():
        for label, group, n, got in by_one_at_a_time(per_mix):
            cells = [
                "-" if group == "best-effort" and k in guaranteed_only else _fmt(k, got[k])
                for k in PAIR_FIGURES
            ]
            lines.append(f"| {name} | {label} | {group} | {n} | " + " | ".join(cells) + " |")
    return lines


def result_line(scores: dict[str, list[MixScore]], mixes: int, seed: int) -> str:
    parts = []
    for name, per_mix in scores.items():
        prefix = f"{name}_" if len(scores) > 1 else ""
        got = figures(per_mix)
        parts += [f"{prefix}{k}={_fmt(k, got[k])}" for k in FIGURES]
    return "RESULT " + " ".join([*parts, f"mixes={mixes}", f"seed={seed}"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    scores: dict[str, list[MixScore]] = {name: [] for name in args.names}
    for index in range(args.mixes):
        mix = generate_mix(
            args.seed,
            index,
            seconds=args.seconds,
            sample_period=args.sample_period,
            deep_queues=args.deep_queues,
        )
        refs = references(mix, args.settle)
        this: dict[str, MixScore] = {}
        for name in args.names:
            factory = with_node_wakes(CONTROLLERS[name], args.node_wakes, f"wakes:{args.seed}:{index}")
            trace = simulate_mix(mix, mix.members, factory)
            this[name] = score_mix(name, mix, refs, trace, args.settle)
            scores[name].append(this[name])
        if args.table:
            print("\n".join(mix_table(mix, refs, this)) + "\n", flush=True)
    print(
        f"# {args.mixes} mixes of seed {args.seed}, {args.seconds:g} s each (two phases), settle "
        f"{args.settle:g} s, controllers {', '.join(args.names)}: {time.monotonic() - started:.1f} s"
    )
    print("\n".join(summary(scores)))
    print("\n".join(["", *one_at_a_time_table(scores)]))
    if args.json is not None:
        rows = [row for per_mix in scores.values() for s in per_mix for row in s.rows()]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(result_line(scores, args.mixes, args.seed))
    return 0


if __name__ == "__main__":
    sys.modules.setdefault("scenarios", sys.modules[__name__])  # what --load modules register with
    sys.exit(main())
