"""Compute-cap accuracy on the simulated GPU engine, for every workload pattern and policy.

Per pattern and scenario, a fresh simulated node: the GPU server (queued kernels keep
running while their submitter is frozen, time-slicing between contexts, NVML samples per
sample period, late) outside every container; a real ``vcuda-agent run`` that measures the
workloads through those samples and freezes their real cgroups; one real ``sim-workload``
process per container. What each container got is the GPU server's ground truth, in 0.5 s
windows, for ``--seconds`` after its workload started.

``--model`` runs the same scenarios in virtual time instead: the same engine, programs and
controller (``Enforcer``) in this process, no OS (a frozen program is not stepped). Minutes
of GPU time take a second, so parameter sweeps are cheap; the real run is the reference.

Expected use per window: fixed-share → its cap; burst-share → its limit (100) while no
neighbour is active, its request while one is; best-effort → what is left; never more than
the pattern asks of an idle GPU. Scored (the error columns of RESULT): every container held
to less than what its workload asks; best-effort ones and a burst-share one alone (never
throttled: it uses what its workload asks) are listed, not scored. ``bursty`` workloads report
their on/off phases: a container is expected to use nothing while off, and its error is
its use per second of being on, against the target.

    sudo .venv/bin/python bench/enforcement.py [--pattern train,infer,graph,bursty,burn]
        [--sample-period S] [--timeslice-ms MS] [--kernel-ms MS] [--seed N] [--seconds S]
        [--sample-delay S] [--sample-jitter S] [--settle S] [--model]
        [--actuator freezer|mps|auto [--mps-advisory-limits] [--driver-mps-v3 [--pods-claim-non-root]]]
        [--mps-samples server|client]

``--actuator mps`` (or ``auto``, the same on the engine, which can always run MPS) runs the
agent in sharing mode mps. As the product does by default, that uses no MPS limit a tenant
can lift, i.e. none on this driver: the freezer holds the shares. With
``--mps-advisory-limits`` each container is an MPS client at its ceiling's whole TPCs, the
duty cycles on top; ``--mps-samples`` says whom NVML credits with an MPS client's work. Both
add the scenario of a tenant with 10 cores that sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 in
its own env beside fixed 50 and fixed 40 (RESULT ``mps_cheat_gain_pp``: its use over its
grant; its rows are left out of every other figure). ``--driver-mps-v3``: the engine's driver
has MPS v3 (r615+), the agent detects it and binds each share's limits to its cgroup on the
daemon's side, where the tenant's env cannot raise them (unverified on hardware), for pods
whose spec proves they cannot run as root (``--pods-claim-non-root``; without it the pods have
no securityContext and get no MPS grant: the time-sliced freezer holds them).

Last line: ``RESULT max_abs_error_pp=... max_settle_s=... burn_error_pp=... infer_p99_ms=...``
(max_abs_error_pp and max_settle_s over every capped container of every pattern but burn),
plus ``mps_max_abs_error_pp=... mps_burn_error_pp=... mps_max_shortfall_pp=...`` with
--actuator mps/auto (every pattern, burn included; the burn rows alone; the most any scored
container got below its expected use, i.e. below its guarantee) and
``mps_fixed_max_abs_error_pp=...`` (the fixed-share rows of every pattern).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from enforcement_model import Box, Run, run_model

from agent.domain.annotations import POLICY
from agent.emulators.enforcednode import enforced_node, exit_on_sigterm
from agent.platform.gpu.sim.programs import PATTERNS, PatternSpec

WINDOW_S = 0.5
SETTLE_BAND_PP = 5.0
# infer: 8 closed-loop clients offering 3 GPUs of requests (whatever --kernel-ms): a
# server loaded past any cap, whose latency stays bounded (each client waits for its answer).
INFER_LOAD = 3.0
INFER_CLIENTS = 8
BURSTY_ON_S, BURSTY_OFF_S = 8.0, 4.0


SCENARIOS: list[tuple[str, list[Box]]] = [
    ("fixed 30 alone", [Box("a", 30, "fixed-share")]),
    ("fixed 60 alone", [Box("a", 60, "fixed-share")]),
    ("burst 30 alone", [Box("a", 30, "burst-share")]),
    ("fixed 30 + fixed 60", [Box("a", 30, "fixed-share"), Box("b", 60, "fixed-share")]),
    ("burst 30 + burst 50", [Box("a", 30, "burst-share"), Box("b", 50, "burst-share")]),
    ("fixed 40 + best-effort 30", [Box("a", 40, "fixed-share"), Box("b", 30, "best-effort")]),
]
# With --actuator mps/auto: a tenant with 10 cores sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100
# in its own container beside fixed 50 and fixed 40 (docs/security.md).
CHEAT = (
    "cheat 10 + fixed 50 + fixed 40",
    [Box("t", 10, "fixed-share", cheat=True), Box("a", 50, "fixed-share"), Box("b", 40, "fixed-share")],
)
CHEAT_ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
NON_ROOT_SPEC = {"runAsUser": 1000, "runAsNonRoot": True, "allowPrivilegeEscalation": False}


def pattern_spec(pattern: str, kernel_ms: float | None, seed: int) -> PatternSpec:
    spec = PatternSpec(pattern, kernel_ms=kernel_ms, seed=seed, on_s=BURSTY_ON_S, off_s=BURSTY_OFF_S)
    if pattern == "infer":  # the same load at any kernel length
        rate = INFER_LOAD / (spec.n_kernels * spec.kernel_s)
        spec = PatternSpec(pattern, kernel_ms=kernel_ms, seed=seed, rate=rate, clients=INFER_CLIENTS)
    return spec


def workload_args(spec: PatternSpec) -> tuple[str, ...]:
    args = ["--pattern", spec.pattern, "--kernel-ms", f"{spec.kernel_s * 1000:g}", "--seed", str(spec.seed)]
    if spec.pattern == "infer":
        args += ["--rate", f"{spec.rate:g}", "--clients", str(spec.clients)]
    if spec.pattern == "bursty":
        args += ["--on", f"{spec.on_s:g}", "--off", f"{spec.off_s:g}"]
    return tuple(args)


def on_fraction(phases: list[tuple[float, bool]], start: float, end: float) -> float:
    """Share of [start, end) the workload was on (no phases: always)."""
    if not phases:
        return 1.0
    on_time, state, since = 0.0, False, start
    for at, now_on in phases:
        if at > start:
            if state:
                on_time += min(at, end) - since
            if at >= end:
                break
        since, state = max(at, start), now_on
    else:
        if state:
            on_time += end - since
    return max(0.0, min(1.0, on_time / (end - start)))


def expected(boxes: list[Box], demand: float, on: list[float]) -> list[float]:
    """Each container's expected use in one window (see the module docstring)."""
    active = [i for i, f in enumerate(on) if f > 0]
    out = [0.0] * len(boxes)
    for i, box in enumerate(boxes):
        if box.policy == "fixed-share":
            target = float(box.cores)
        elif box.policy == "burst-share":
            target = float(box.cores if any(j != i for j in active) else 100)
        else:
            continue
        out[i] = min(target, 100 * demand) * on[i]
    for i, box in enumerate(boxes):
        if box.policy == "best-effort":
            out[i] = max(0.0, min(100 * demand, 100 - sum(out))) * on[i]
    return out


@dataclass(frozen=True)
class Row:
    line: str
    error_pp: float | None  # None: not scored (best-effort)
    policy: str
    settle_s: float
    p99_ms: float | None
    ideal_p99_ms: float | None = None  # the same share delivered continuously
    cheat: bool = False  # the tenant that lifts its own MPS limit (CHEAT)


def phases_of(report: dict[str, object]) -> list[tuple[float, bool]]:
    raw = report.get("phases")
    return [(float(t), bool(on)) for t, on in raw] if isinstance(raw, list) else []


def score(
    pattern: str,
    name: str,
    boxes: list[Box],
    run: Run,
    *,
    demand: float,
    settle: float,
    ideal: Run | None = None,
) -> list[Row]:
    phases = [phases_of(r) for r in run.reports] if run.reports else [[] for _ in boxes]
    n = min(len(w) for w in run.windows)
    on = [
        [on_fraction(phases[i], run.starts[w], run.starts[w] + WINDOW_S) for w in range(n)]
        for i in range(len(boxes))
    ]
    want = [expected(boxes, demand, [on[i][w] for i in range(len(boxes))]) for w in range(n)]
    active = [tuple(on[j][w] > 0 for j in range(len(boxes))) for w in range(n)]  # who is on, per window
    skip = int(settle / WINDOW_S)
    rows = []
    for i, box in enumerate(boxes):
        used = run.windows[i][skip:n]
        exp = [want[w][i] for w in range(skip, n)]
        on_s = sum(on[i][skip:n])
        mean_used = sum(used) / on_s if on_s else 0.0
        mean_exp = sum(exp) / on_s if on_s else 0.0
        err = mean_used - mean_exp
        settled = settle_time(run.windows[i][:n], [want[w][i] for w in range(n)], active)
        p99_ms = _p99(run, i)
        ideal_ms = _p99(ideal, i) if ideal is not None else None
        line = (
            f"| {pattern} | {name} | {box.name}: {box.policy} {box.cores} | {mean_exp:.0f} | "
            f"{mean_used:.1f} | {err:+.1f} | {settled:.1f} | {'' if p99_ms is None else f'{p99_ms:.0f}'} | "
            f"{'' if ideal_ms is None else f'{ideal_ms:.0f}'} |"
        )
        # Scored: containers held to a target below the whole GPU. A burst-share container
        # alone may use it all and is never throttled: what it uses is what its workload
        # asks (an infer server's own gaps between requests are not an error of the cap).
        held = box.policy != "best-effort" and mean_exp < 100 * demand - 1e-9
        rows.append(
            Row(
                line + ("" if held else " (not scored)"),
                err if held else None,
                box.policy,
                settled,
                p99_ms,
                ideal_ms,
            )
        )
    return rows


def _p99(run: Run, i: int) -> float | None:
    p99 = run.reports[i].get("latency_p99_ms") if run.reports else None
    return float(p99) if isinstance(p99, int | float) else None


def settle_time(used: list[float], want: list[float], active: list[tuple[bool, ...]]) -> float:
    """After each change of who is active (the start, a bursty phase edge), the seconds
    until the 2 s rolling mean of the use enters ±SETTLE_BAND_PP of the expected and stays
    there until the next change; the longest of those."""
    span = int(2 / WINDOW_S)
    edges = [0] + [i for i in range(1, len(active)) if active[i] != active[i - 1]] + [len(used)]
    longest = 0.0
    for first, end in itertools.pairwise(edges):
        settled_at = end
        for i in range(end - 1, first - 1, -1):
            lo = max(first, i - span + 1)
            if abs(sum(used[lo : i + 1]) - sum(want[lo : i + 1])) / (i + 1 - lo) > SETTLE_BAND_PP:
                break
            settled_at = i
        longest = max(longest, (settled_at - first + 1) * WINDOW_S)
    return longest


def run_real(boxes: list[Box], spec: PatternSpec, args: argparse.Namespace, workdir: Path) -> Run:
    gpu_args = [
        "--timeslice-ms", f"{args.timeslice_ms:g}", "--sample-delay", f"{args.sample_delay:g}",
        "--sample-jitter", f"{args.sample_jitter:g}", "--seed", str(args.seed),
        "--mps-samples", args.mps_samples,
    ]  # fmt: skip
    if args.sample_period is not None:
        gpu_args += ["--sample-period", f"{args.sample_period:g}"]
    if args.driver_mps_v3:
        gpu_args += ["--driver-mps-v3"]
    agent_args: tuple[str, ...] = ("--log-level", "WARNING", "--device-guard", "off", "--no-ioctl-tracing")
    agent_args = (*agent_args, "--sharing-mode", args.actuator)
    if args.mps_advisory_limits:
        agent_args = (*agent_args, "--mps-advisory-limits")
    with enforced_node(workdir, gpu_args=tuple(gpu_args), agent_args=agent_args) as node:
        running = []
        for box in boxes:
            report = workdir / f"{box.name}.json"
            # Latency after settling, as the error.
            extra = (*workload_args(spec), "--report", str(report), "--latency-after", f"{args.settle:g}")
            env = CHEAT_ENV if box.cheat else None
            running.append(
                node.run_pod(
                    f"pod-{box.name}",
                    box.cores,
                    annotations={POLICY: box.policy},
                    extra=extra,
                    env=env,
                    security=NON_ROOT_SPEC if args.pods_claim_non_root else None,
                )
            )
        windows: list[list[float]] = [[] for _ in boxes]
        starts: list[float] = []
        last, last_t = node.gpu_seconds(running), time.monotonic()
        end = last_t + args.seconds
        while last_t < end:
            threading.Event().wait(WINDOW_S)
            now, now_t = node.gpu_seconds(running), time.monotonic()
            for i in range(len(boxes)):
                windows[i].append(100 * (now[i] - last[i]) / (now_t - last_t))
            starts.append(last_t)
            last, last_t = now, now_t
        node.stop_agent()  # everything thawed: the workloads can stop and write their reports
        for container in running:
            container.proc.send_signal(signal.SIGTERM)
            container.proc.wait(timeout=20)
        reports = [json.loads((workdir / f"{b.name}.json").read_text()) for b in boxes]
    return Run(windows, starts, reports)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pattern", default=",".join(PATTERNS), help="comma-separated patterns (default all)"
    )
    parser.add_argument(
        "--sample-period", type=float, help="NVML sample period, s (default the model's, 1/6)"
    )
    parser.add_argument("--sample-delay", type=float, default=0.25, help="samples arrive this late, s")
    parser.add_argument("--sample-jitter", type=float, default=0.25, help="...plus up to this much, s")
    parser.add_argument("--timeslice-ms", type=float, default=2.0, help="time-slice between contexts")
    parser.add_argument("--kernel-ms", type=float, help="kernel length (default: the pattern's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and sample jitter")
    parser.add_argument("--seconds", type=float, default=25.0, help="measured per scenario (default 25)")
    parser.add_argument("--settle", type=float, default=5.0, help="left out of the error (default 5)")
    parser.add_argument("--model", action="store_true", help="virtual time in this process (see above)")
    parser.add_argument(
        "--actuator",
        choices=("freezer", "mps", "auto"),
        default="freezer",
        help="the agent's --sharing-mode: freezer (default), mps or auto (MPS limits, duty cycles on top)",
    )
    parser.add_argument(
        "--mps-advisory-limits",
        action="store_true",
        help="with --actuator mps/auto: the agent's --mps-advisory-limits (MPS limits a tenant can "
        "lift are used; without it the freezer holds the shares, as the product does by default)",
    )
    parser.add_argument(
        "--driver-mps-v3",
        action="store_true",
        help="with --actuator mps/auto: an r615+ driver whose MPS daemon binds limits to cgroups "
        "(MPS v3 namespaces; the agent detects it and uses them: enforceable, unverified on hardware)",
    )
    parser.add_argument(
        "--pods-claim-non-root",
        action="store_true",
        help="with --driver-mps-v3: the pods' specs prove non-root (runAsUser 1000, runAsNonRoot, "
        "allowPrivilegeEscalation: false), so each gets an MPS v3 namespace; with --model they run "
        "as uids 1000+n, for real the bench's workloads still run as root, so the agent's uid "
        "readings take that trust back (the backstop). Default: no securityContext, as most pods: "
        "no MPS grant, the time-sliced freezer",
    )
    parser.add_argument(
        "--mps-samples",
        choices=("server", "client"),
        default="server",
        help="under MPS, NVML credits the clients' work to the MPS server (default, as NVIDIA documents) "
        "or to each client",
    )
    args = parser.parse_args(argv)
    bad = [p for p in args.pattern.split(",") if p not in PATTERNS]
    if bad:
        parser.error(f"--pattern: unknown {', '.join(bad)} (known: {', '.join(PATTERNS)})")
    return args


Runner = Callable[[list[Box], PatternSpec, argparse.Namespace, Path], Run]


def main(argv: list[str] | None = None, real: Runner = run_real) -> int:
    """The table and RESULT line; ``real`` runs a scenario outside ``--model``."""
    args = parse(argv)
    # A SIGTERM unwinds like Ctrl-C: each scenario's agent, GPU server and workloads are
    # stopped and their cgroups removed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workdir = Path(tempfile.mkdtemp(prefix="vc-enf-", dir="/tmp"))
    mode = "model (virtual time)" if args.model else "real agent, containers and freezer"
    mps = f", MPS samples per {args.mps_samples}" if args.actuator != "freezer" else ""
    print(
        f"# {mode}; sharing mode {args.actuator}{mps}; sample period {args.sample_period or 'default'} s, "
        f"timeslice {args.timeslice_ms:g} ms"
    )
    print(
        "| pattern | scenario | container | expected % | used % | error pp | settle s | p99 ms "
        "| continuous p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows: dict[str, list[Row]] = {}
    try:
        for pattern in args.pattern.split(","):
            spec = pattern_spec(pattern, args.kernel_ms, args.seed)
            demand = spec.busy if pattern == "bursty" else spec.demand() or 1.0
            scenarios = SCENARIOS + ([CHEAT] if args.actuator != "freezer" else [])
            for i, (name, boxes) in enumerate(scenarios):
                ideal = (
                    run_model(boxes, spec, args, WINDOW_S, continuous=True) if pattern == "infer" else None
                )
                if args.model:
                    run = run_model(boxes, spec, args, WINDOW_S)
                else:
                    run = real(boxes, spec, args, workdir / f"{pattern}-{i}")
                scored = score(pattern, name, boxes, run, demand=demand, settle=args.settle, ideal=ideal)
                for box, row in zip(boxes, scored, strict=True):
                    print(row.line, flush=True)
                    rows.setdefault(pattern, []).append(replace(row, cheat=box.cheat))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        "# used %: throughput, the work each container got done (kernel time completed: context "
        "switches and idle are not work) as a share of the whole GPU's; a workload alone on "
        "the whole GPU is the burst-share row alone"
    )
    scored = [
        r for p, rs in rows.items() if p != "burn" for r in rs if r.error_pp is not None and not r.cheat
    ]
    burn = [r.error_pp for r in rows.get("burn", []) if r.error_pp is not None]
    p99 = [r.p99_ms for r in rows.get("infer", []) if r.p99_ms is not None and r.error_pp is not None]
    ideal_p99 = [
        r.ideal_p99_ms for r in rows.get("infer", []) if r.ideal_p99_ms is not None and r.error_pp is not None
    ]
    every = [r.error_pp for rs in rows.values() for r in rs if r.error_pp is not None and not r.cheat]
    mps_result = ""
    if args.actuator != "freezer":  # every pattern, burn included; the burn rows alone
        worst_burn = max(burn, key=abs, default=0.0)
        fixed = [
            abs(r.error_pp)
            for rs in rows.values()
            for r in rs
            if r.error_pp is not None and r.policy == "fixed-share" and not r.cheat
        ]
        cheats = [r.error_pp for rs in rows.values() for r in rs if r.cheat and r.error_pp is not None]
        mps_result = (
            f" mps_max_abs_error_pp={max(map(abs, every), default=0):.1f} mps_burn_error_pp={worst_burn:+.1f}"
            # how far any container fell below what it is owed (its guarantee), whatever others got
            f" mps_max_shortfall_pp={max((-e for e in every), default=0):.1f}"
            f" mps_fixed_max_abs_error_pp={max(fixed, default=0):.1f}"
            f" mps_cheat_gain_pp={max(cheats, default=0):+.1f}"
        )
    print(
        "RESULT "
        f"max_abs_error_pp={max((abs(r.error_pp or 0) for r in scored), default=0):.1f} "
        f"max_settle_s={max((r.settle_s for r in scored), default=0):.1f} "
        f"burn_error_pp={max(burn, default=0):+.1f} "
        f"infer_p99_ms={max(p99, default=0):.0f} infer_ideal_p99_ms={max(ideal_p99, default=0):.0f}"
        + mps_result
    )
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops what it started
    raise SystemExit(main())
