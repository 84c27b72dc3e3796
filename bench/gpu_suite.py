"""The GPU script: everything a lent GPU machine should record, in one unattended
run that fits its minutes, writes what it has whatever happens, and needs nothing of this
project but its source tree (standard library, pynvml, PyTorch in the workers; the agent's
own dependencies only for the enforcement stage, which checks for them first).

Why: NVML's per-process samples credit the ONE process resident on the engine at each
sample instant (docs/reference.md, "The driver's samples"), and NVML's aggregation of them
into ``smUtil`` is closed source, so a cap fed by them is only as true as what they mean.
The traces record NVML's raw answers and each worker's own throughput under schedules the
suite imposes itself, to settle how NVML aggregates and what the driver does under
freezing; bench/gpu_replay.py replays them on the simulated GPU (tests/data/gpu-traces/
keeps them as fixtures).

Stages, each guarded (a failure is recorded and the next stage runs), each part skipped
rather than started when it would overrun ``--budget-s``:

1. ``inventory`` (always: it is the gate) -> ``inventory.json``: GPU, driver, CUDA driver,
   which NVML sampling calls the library has and which answer, one raw answer of each, MPS,
   cgroups, BPF, Python, PyTorch. No NVIDIA driver: the inventory of what could be learnt,
   the line ``gpu_suite: no NVIDIA driver (...)``, ``RESULT nvidia=absent``, exit code 3.
2. ``traces`` -> ``traces/trace-<pattern>.jsonl.gz`` (bench/gpu_traces.py; the record
   format in bench/gpu_recording.py).
3. ``mps`` -> ``mps-probe.json`` (bench/gpu_mps_probe.py ``--tricks``, a real daemon only:
   what MPS limits do, and what a tenant can do to them: its own environment, the control
   socket through a read-only pipe directory).
4. ``enforce`` -> ``enforcement.json`` and a printed table (bench/gpu_scenarios.py).

``summary.json`` (rewritten as the run goes): files written, parts skipped and why, errors,
per-stage figures. Nothing else is left under ``--out`` (a lent machine returns at most 8
files): workers' logs and progress files live in a private directory under /tmp.

    python3 bench/gpu_suite.py [--out DIR] [--budget-s 480] [--only inventory,traces,enforce]
        [--patterns train,infer,burn,graph] [--simulate [--quick]] [--wheels DIR]

``--out`` defaults to $OUT, else ./gpu-suite-out. ``--simulate`` runs every stage on the
project's simulated GPU (needs root and cgroup v2, as the real run does); ``--quick`` (with
it) shrinks every segment and scenario to about a second, for the tests.

Last line: ``RESULT nvidia=present|simulated traces=N freezer_max_abs_error_pp=...
freezer_burn_error_pp=... [mps_max_abs_error_pp=...] skipped=N errors=N elapsed_s=...``
(``na``: not measured). Exit code 0, 1 when a part failed, 3 without an NVIDIA driver,
128 + the signal when stopped by SIGTERM/SIGINT (everything thawed, killed and removed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the agent package, without installing this project
    sys.path.insert(1, str(ROOT))

from gpu_budget import Budget, Interrupted, Summary, attempt  # noqa: E402
from gpu_deps import agent_deps  # noqa: E402
from gpu_inventory import host_facts, nvml_inventory, open_nvml, sim_inventory, v2_root  # noqa: E402
from gpu_sources import NvmlSource, SimSource, Source  # noqa: E402
from gpu_traces import TraceSetup, run_traces  # noqa: E402

STAGES = ("inventory", "traces", "mps", "enforce")
# bench/gpu_mps_probe.py --tricks --seconds 3: nine CUDA clients of 3 s, each importing
# PyTorch and creating its context first (an estimate: not yet run on a GPU).
MPS_PROBE_S = 150.0
PATTERNS = ("train", "infer", "burn", "graph")
ENFORCE_SHARE = 0.3  # of the budget left after the inventory, kept for the enforcement stage
DEPS_TIMEOUT_S = 90.0


def _csv(known: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (known: {', '.join(known)})")
        return items

    return parse


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="results directory (default $OUT, else ./gpu-suite-out)")
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="wall seconds for everything (default 480)"
    )
    parser.add_argument(
        "--only", type=_csv(STAGES), default=list(STAGES), help="stages (inventory always runs)"
    )
    parser.add_argument("--patterns", type=_csv(PATTERNS), default=list(PATTERNS), help="workload patterns")
    parser.add_argument(
        "--simulate", action="store_true", help="the project's simulated GPU instead of a real one"
    )
    parser.add_argument(
        "--quick", action="store_true", help="with --simulate: every segment and scenario ~1 s"
    )
    parser.add_argument(
        "--wheels", type=Path, help="wheels of the agent's dependencies (default <repo>/.whl)"
    )
    args = parser.parse_args(argv)
    if args.quick and not args.simulate:
        parser.error("--quick is for --simulate only (a real run's figures need the full segments)")
    return args


def python_env() -> dict[str, str]:
    """Every child's environment: this repository on PYTHONPATH (``python -m agent`` from
    anywhere), output unbuffered."""
    env = dict(os.environ)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Run:
    """One run of the suite: its budget, summary, private work directory and GPU source."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out or Path(os.environ.get("OUT") or "gpu-suite-out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.budget = Budget(args.budget_s)
        self.summary = Summary(self.out / "summary.json", {k: str(v) for k, v in vars(args).items()})
        self.workdir = Path(tempfile.mkdtemp(prefix="vcgs-", dir="/tmp"))  # short: unix socket paths
        self.env = python_env()
        os.environ["PYTHONPATH"] = self.env["PYTHONPATH"]  # the emulators start children from os.environ
        self.source: Source | None = None
        self.result: dict[str, Any] = {"nvidia": "simulated" if args.simulate else "present", "traces": 0}
        self.alone: dict[str, float] = {}

    def say(self, message: str) -> None:
        self.budget.say(message)

    def write_json(self, name: str, doc: Any) -> Path:
        path = self.out / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        self.summary.file(path)
        return path

    # Stage 1 ---------------------------------------------------------------------------------
    def inventory(self) -> str | None:
        """Write inventory.json; why there is no NVIDIA driver (None: there is one, or --simulate)."""
        self.say("inventory: host, cgroups, BPF, Python, PyTorch")
        doc: dict[str, Any] = {"host": host_facts(sys.executable), "simulated": self.args.simulate}
        if self.args.simulate:
            self.say("inventory: starting the simulated GPU")
            sim = SimSource(self.workdir / "sim")
            self.source = sim
            time.sleep(0.5)  # a few sample periods, for the sampling calls to have something
            doc["nvidia"] = sim_inventory(sim.backend)
        else:
            nvml, reason = open_nvml()
            if nvml is None:
                doc["nvidia"] = f"no NVIDIA driver: {reason}"
                self.write_json("inventory.json", doc)
                return reason
            self.source = NvmlSource(nvml)
            try:
                doc["nvidia"] = nvml_inventory(nvml)
            except Exception as err:  # noqa: BLE001  (the source works; what failed is on record)
                doc["nvidia"] = {"error": f"{type(err).__name__}: {err}"}
                self.summary.error("inventory/nvml", err)
        self.write_json("inventory.json", doc)
        gpu = self.source.gpu_name
        self.say(f"inventory: {gpu}, driver {self.source.driver}; written to {self.out / 'inventory.json'}")
        self.result["gpu"] = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_")
        return None

    # Stage 2 ---------------------------------------------------------------------------------
    def traces(self, keep_s: float) -> None:
        assert self.source is not None
        setup = TraceSetup(
            self.source, self.out, self.workdir, v2_root(), sys.executable, self.env, quick=self.args.quick
        )
        if setup.v2_root is None:
            self.summary.stage(
                "traces", note="no cgroup v2 hierarchy: SIGSTOP/SIGCONT stand in for the freezer"
            )
        run_traces(setup, self.args.patterns, self.budget, self.summary, keep_s)
        self.summary.stage("traces", patterns=setup.outcomes)
        for pattern, outcome in setup.outcomes.items():
            rate = outcome.get("alone_steps_per_s")
            if rate:
                self.alone[pattern] = float(rate)

    # Stage 3 ---------------------------------------------------------------------------------
    def enforce_ready(self) -> str:
        """Why the enforcement stage cannot run ("": it can)."""
        if v2_root() is None:
            return "no cgroup v2 hierarchy (the enforced node needs one)"
        wheels = self.args.wheels or (ROOT / ".whl")
        why, tried = agent_deps(
            sys.executable,
            self.env,
            wheels=wheels if wheels.is_dir() else None,
            site=self.workdir / "site",
            timeout_s=min(DEPS_TIMEOUT_S, max(self.budget.left() / 4, 5.0)),
        )
        os.environ["PYTHONPATH"] = self.env["PYTHONPATH"]
        self.summary.stage("enforce", dependencies=tried)
        return why or ""

    def enforce(self) -> None:
        import gpu_scenarios  # noqa: PLC0415

        setup = gpu_scenarios.EnforceSetup(
            self.args.simulate, self.workdir / "enforce", sys.executable, self.args.quick, dict(self.alone)
        )
        gpu = self.result.get("gpu")

        def write(doc: dict[str, Any]) -> None:
            self.write_json("enforcement.json", {"gpu": gpu, **doc})
            self.result.update({k: v for k, v in doc["result"].items() if v is not None})

        write(gpu_scenarios.run_enforcement(setup, self.args.patterns, self.budget, self.summary, write))

    def enforce_estimate(self) -> float:
        import gpu_scenarios  # noqa: PLC0415

        setup = gpu_scenarios.EnforceSetup(
            self.args.simulate, self.workdir, sys.executable, self.args.quick, {}
        )
        return gpu_scenarios.estimate_s(setup, 1)

    def mps_probe(self) -> None:
        """Stage 3 (see the module docstring): its own process, its output streamed."""
        out = self.out / "mps-probe.json"
        argv = [sys.executable, str(ROOT / "bench" / "gpu_mps_probe.py"), "--seconds", "3", "--tricks"]
        done = subprocess.run(
            [*argv, "--json", str(out)], env=self.env, timeout=MPS_PROBE_S + 60, check=False
        )
        if out.exists():
            self.summary.file(out)
        self.summary.stage("mps", exit_code=done.returncode)
        if done.returncode != 0:
            raise RuntimeError(f"gpu_mps_probe.py exited with {done.returncode}")

    def traces_written(self) -> int:
        started = self.summary.doc["started_w"]
        found = [p for p in (self.out / "traces").glob("trace-*.jsonl.gz") if p.stat().st_mtime >= started]
        for path in found:
            self.summary.file(path)
        return len(found)

    def close(self) -> None:
        if self.source is not None:
            try:
                self.source.close()
            except Exception as err:  # noqa: BLE001  (recorded; the clean-up goes on)
                self.summary.error("close", err)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    for s in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the clean-up short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def result_line(result: dict[str, Any]) -> str:
    """The last line: ``na`` for a figure not measured; without a driver, that alone."""
    if result.get("nvidia") == "absent":
        return "RESULT nvidia=absent"

    def show(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    keys = ["nvidia", "gpu", "traces", "freezer_max_abs_error_pp", "freezer_burn_error_pp"]
    keys += ["mps_max_abs_error_pp", "skipped", "errors", "interrupted", "elapsed_s"]
    always = {"nvidia", "traces", "freezer_max_abs_error_pp", "freezer_burn_error_pp", "elapsed_s"}
    return "RESULT " + " ".join(
        f"{k}={show(result.get(k, 'na'))}" for k in keys if k in result or k in always
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run(args)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        try:
            reason = run.inventory()
        except Exception as err:  # noqa: BLE001  (no GPU source to measure with: clean up, report)
            run.say(f"inventory: FAILED: {type(err).__name__}: {err}")
            run.summary.error("inventory", err)
            return 1
        if reason is not None:
            path = run.out / "inventory.json"
            print(f"gpu_suite: no NVIDIA driver ({reason}): ", end="")
            print(f"nothing to measure here; inventory written to {path}", flush=True)
            run.summary.stage("inventory", nvidia="absent", reason=reason)
            run.result = {"nvidia": "absent"}
            return 3
        keep = 0.0
        if "enforce" in args.only:
            why = attempt("enforce/dependencies", 10.0, run.budget, run.summary, run.enforce_ready)
            if why:
                run.say(f"enforce: will be skipped: {why}")
                run.summary.skip("enforce", why)
            elif why is not None:  # "" : ready (None: the check itself failed, on record)
                keep = max(run.enforce_estimate(), ENFORCE_SHARE * run.budget.left())
        probe = MPS_PROBE_S if "mps" in args.only and not args.simulate else 0.0  # kept from the traces too
        if "traces" in args.only:
            attempt("traces", 0.0, run.budget, run.summary, lambda: run.traces(keep + probe))
        if "mps" in args.only:
            if args.simulate:
                run.summary.skip("mps", "the MPS probe needs the real daemon and CUDA (a lent GPU)")
            elif run.budget.fits(MPS_PROBE_S + keep):
                attempt("mps", MPS_PROBE_S, run.budget, run.summary, run.mps_probe)
            else:
                run.summary.skip("mps", "the budget left is kept for the enforcement stage")
        if keep:
            attempt("enforce", run.enforce_estimate(), run.budget, run.summary, run.enforce)
    except Interrupted as stop:
        run.say(f"stopped by signal {stop.signum}: everything thawed, workers killed, cgroups removed")
        run.result["interrupted"] = stop.signum
        code = 128 + stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        run.close()
        if run.result.get("nvidia") != "absent":
            run.result["traces"] = run.traces_written()  # those of a pattern cut short by a signal too
            run.result.update(
                skipped=len(run.summary.doc["skipped"]),
                errors=len(run.summary.doc["errors"]),
                elapsed_s=round(run.budget.elapsed(), 1),
            )
        run.summary.doc["finished"] = True
        run.summary.result(**run.result)
        print(result_line(run.result), flush=True)
    return 1 if code == 0 and run.summary.doc["errors"] else code


if __name__ == "__main__":
    raise SystemExit(main())
