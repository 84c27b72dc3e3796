"""Enforcement scenarios by throughput (bench/gpu_suite.py, stage ``enforce``): the real agent
holds one worker per container to its cap, as bench/gpu_enforcement.py runs it (Kubernetes
mode against the emulated API server and kubelet, the device plugin's Allocate, one cgroup
per container), and each container is scored by its own throughput: its steps per second
over the same loop's rate alone on the whole GPU (the traces' ``A alone``, else a run of
one container on a whole GPU first). NVML's view (the bench's estimator over
``nvmlDeviceGetProcessUtilization``) is the second column on a real GPU; on the simulated
one it is the GPU server's ground truth.

Scenarios: fixed 30 alone, fixed 30 + fixed 60, fixed 40 + best-effort 30; for train, infer
and graph (freezer mode), then burn if time remains; then MPS mode (``--sharing-mode mps``)
for train where ``nvidia-cuda-mps-control`` is on PATH (the simulator always has its stand-in).

The agent needs this project's dependencies, which a GPU machine may lack: bench/gpu_deps.py
checks (and where it can, installs) them before the stage starts.
"""

from __future__ import annotations

import functools
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_budget import Budget, Summary, attempt
from gpu_traces import BENCH, SIM_ARGS
from gpu_workers import ProgressTail

SCENARIOS: list[tuple[str, list[tuple[str, int, str]]]] = [
    ("fixed 30 alone", [("a", 30, "fixed-share")]),
    ("fixed 30 + fixed 60", [("a", 30, "fixed-share"), ("b", 60, "fixed-share")]),
    ("fixed 40 + best-effort 30", [("a", 40, "fixed-share"), ("b", 30, "best-effort")]),
]
SETTLE_S, MEASURE_S = 3.0, 10.0
QUICK_SETTLE_S, QUICK_MEASURE_S = 0.5, 1.0
OVERHEAD_S = {"real": 60.0, "sim": 14.0}  # agent start, workers' start-up, teardown
MEMORY_MIB = 8192  # vcuda-memory per container: burn holds three 8192² fp32 matrices and a context
WINDOW_S = 0.5


@dataclass
class EnforceSetup:
    simulated: bool
    workdir: Path
    python: str
    quick: bool
    alone: dict[str, float]  # pattern -> steps per second alone (from the traces)

    @property
    def mode(self) -> str:
        return "sim" if self.simulated else "real"

    @property
    def settle_measure(self) -> tuple[float, float]:
        return (QUICK_SETTLE_S, QUICK_MEASURE_S) if self.quick else (SETTLE_S, MEASURE_S)


def plan(patterns: list[str], simulated: bool) -> list[tuple[str, str]]:
    """(sharing mode, pattern) in the order they run."""
    order = [p for p in ("train", "infer", "graph", "burn") if p in patterns]
    runs: list[tuple[str, str]] = [("freezer", p) for p in order]
    if "train" in patterns and (simulated or shutil.which("nvidia-cuda-mps-control")):
        runs.append(("mps", "train"))
    return runs


def estimate_s(setup: EnforceSetup, n_scenarios: int) -> float:
    settle, measure = setup.settle_measure
    return n_scenarios * (OVERHEAD_S[setup.mode] + settle + measure)


def run_enforcement(
    setup: EnforceSetup,
    patterns: list[str],
    budget: Budget,
    summary: Summary,
    write: Callable[[dict[str, Any]], object],
) -> dict[str, Any]:
    """Every scenario that fits; the rows and the RESULT figures (``enforcement.json``, handed
    to ``write`` after every scenario too, so that a run cut short keeps what it measured)."""
    rows: list[dict[str, Any]] = []
    skipped_modes: list[str] = []

    def doc() -> dict[str, Any]:
        return {
            "rows": rows,
            "result": result_figures(rows),
            "alone_steps_per_s": setup.alone,
            "not_run": skipped_modes,
            "second_column": SimContainers.second_kind if setup.simulated else RealContainers.second_kind,
        }

    if not setup.simulated and not shutil.which("nvidia-cuda-mps-control") and "train" in patterns:
        skipped_modes.append("mps: nvidia-cuda-mps-control is not on PATH")
        summary.skip("enforce/mps", "nvidia-cuda-mps-control is not on PATH")
    print("| mode | pattern | scenario | container | cap | throughput % | error pp | second % |", flush=True)
    for mode, pattern in plan(patterns, setup.simulated):
        for i, (name, boxes) in enumerate(SCENARIOS):
            part = f"enforce/{mode}/{pattern}/{name}"
            need = estimate_s(setup, 1) + (0 if pattern in setup.alone else estimate_s(setup, 1))
            # A short directory: the MPS daemon's control socket lies four levels under it.
            workdir = setup.workdir / f"{mode[0]}-{pattern}-{i}"
            case = Case(mode, pattern, name, boxes, workdir)
            got = attempt(part, need, budget, summary, functools.partial(_scenario, setup, case))
            for row in got or ():
                rows.append(row)
                error = "" if row["error_pp"] is None else f"{row['error_pp']:+.1f}"
                second = "" if row["second_pct"] is None else f"{row['second_pct']:.1f}"
                print(
                    f"| {mode} | {pattern} | {name} | {row['container']} | {row['cap']} | "
                    f"{row['throughput_pct']:.1f} | {error} | {second} |",
                    flush=True,
                )
            write(doc())
    return doc()


def result_figures(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def errors(mode: str, patterns: tuple[str, ...]) -> list[float]:
        return [
            r["error_pp"]
            for r in rows
            if r["mode"] == mode and r["pattern"] in patterns and r["error_pp"] is not None
        ]

    freezer = errors("freezer", ("train", "infer", "graph"))
    burn = errors("freezer", ("burn",))
    mps = errors("mps", ("train", "infer", "graph", "burn"))
    return {
        "freezer_max_abs_error_pp": max(map(abs, freezer)) if freezer else None,
        "freezer_burn_error_pp": max(burn, key=abs) if burn else None,
        "mps_max_abs_error_pp": max(map(abs, mps)) if mps else None,
    }


@dataclass(frozen=True)
class Case:
    """One scenario of one pattern in one sharing mode."""

    mode: str
    pattern: str
    name: str
    boxes: list[tuple[str, int, str]]  # (container, cores, policy)
    workdir: Path


def _scenario(setup: EnforceSetup, case: Case) -> list[dict[str, Any]]:
    mode, pattern, name, boxes, workdir = case.mode, case.pattern, case.name, case.boxes, case.workdir
    if pattern not in setup.alone:
        setup.alone[pattern] = _calibrate(setup, pattern)
    settle, measure = setup.settle_measure
    node_cm, driver = _node(setup, workdir, mode)
    with node_cm as node:
        running = [driver.start(node, f"pod-{b}", cores, policy, pattern) for b, cores, policy in boxes]
        driver.wait_ready(running)
        second = driver.second_column(node, running, settle, measure)
        m1 = time.time()
        m0 = m1 - measure
        stepped = _stop_and_read(node, running)
        rows = []
        for (box, cores, policy), container, steps in zip(boxes, running, stepped, strict=True):
            n = sum(1 for t in steps if m0 < t <= m1)
            thr = 100 * n / measure / setup.alone[pattern]
            scored = policy == "fixed-share"
            rows.append(
                {
                    "mode": mode,
                    "pattern": pattern,
                    "scenario": name,
                    "container": f"{box}: {policy} {cores}",
                    "cap": cores,
                    "throughput_pct": thr,
                    "error_pp": thr - cores if scored else None,
                    "second_pct": second[running.index(container)],
                    "second": driver.second_kind,
                }
            )
    return rows


def _calibrate(setup: EnforceSetup, pattern: str) -> float:
    """Steps per second of the pattern's loop alone on a whole GPU (a 100-core container,
    never throttled), where the traces did not measure it."""
    settle, measure = setup.settle_measure
    node_cm, driver = _node(setup, setup.workdir / f"cal-{pattern}", "freezer")
    with node_cm as node:
        container = driver.start(node, "pod-alone", 100, "fixed-share", pattern)
        driver.wait_ready([container])
        time.sleep(settle + measure)
        m1 = time.time()
        steps = _stop_and_read(node, [container])[0]
        rate = sum(1 for t in steps if m1 - measure < t <= m1) / measure
    print(f"# calibration: {pattern}: {rate:.1f} steps/s alone on the whole GPU", flush=True)
    if rate <= 0:
        raise RuntimeError(f"{pattern}: no steps alone on the whole GPU: cannot score by throughput")
    return rate


def _stop_and_read(node: Any, running: list[Running]) -> list[list[float]]:
    """Each container's step times, all of them: a worker flushes its steps every 0.1 s while
    it runs, and one frozen holds the steps it finished before the freeze until it is thawed.
    So: stop the agent (it thaws everything on its way out), then each workload (SIGTERM: it
    flushes), then read."""
    node.stop_agent()
    for r in running:
        if r.proc.proc.poll() is None:
            r.proc.proc.send_signal(signal.SIGTERM)
    for r in running:
        try:
            r.proc.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            r.proc.proc.kill()
    return [ProgressTail(r.progress).read() for r in running]


def _node(setup: EnforceSetup, workdir: Path, mode: str) -> tuple[Any, Any]:
    """(the enforced node's context manager, the driver of its containers)."""
    from gpu_enforcement import GPU_NODE_ARGS  # noqa: PLC0415  (imports the agent: after the deps check)

    from agent.emulators.enforcednode import enforced_node  # noqa: PLC0415

    agent_args = ("--log-level", "WARNING", "--sharing-mode", mode, *GPU_NODE_ARGS)
    if setup.simulated:
        return enforced_node(workdir, agent_args=agent_args), SimContainers(setup)
    return enforced_node(workdir, None, agent_args=agent_args), RealContainers(setup)


@dataclass
class Running:
    proc: Any  # the runtime's RunningContainer
    progress: Path
    ready: Path | None
    uuid: str = ""

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


class SimContainers:
    second_kind = "gpu server ground truth %"

    def __init__(self, setup: EnforceSetup) -> None:
        self.setup = setup

    def start(self, node: Any, name: str, cores: int, policy: str, pattern: str) -> Running:
        from agent.domain.annotations import POLICY  # noqa: PLC0415

        progress = node.workdir / f"{name}.steps"
        extra = (*SIM_ARGS[pattern], "--progress", str(progress))
        return Running(node.run_pod(name, cores, annotations={POLICY: policy}, extra=extra), progress, None)

    def wait_ready(self, running: list[Running]) -> None:
        return None  # run_pod returned once each workload was on its GPU

    def second_column(
        self, node: Any, running: list[Running], settle: float, measure: float
    ) -> list[float | None]:
        time.sleep(settle)
        share = node.utilization([r.proc for r in running], measure)
        return [float(s) for s in share]


class RealContainers:
    second_kind = "NVML (bench estimator) %"

    def __init__(self, setup: EnforceSetup) -> None:
        self.setup = setup

    def start(self, node: Any, name: str, cores: int, policy: str, pattern: str) -> Running:
        from agent.domain.annotations import POLICY  # noqa: PLC0415
        from agent.emulators.cluster import container_id  # noqa: PLC0415
        from agent.emulators.enforcednode import pod_manifest  # noqa: PLC0415
        from agent.platform.cgroups.paths import QosClass  # noqa: PLC0415

        memory = MEMORY_MIB if cores < 100 else None
        admission = node.node.run_pod(pod_manifest(name, cores, memory, {POLICY: policy}))
        response = admission.containers[0].response
        pod = node.api.pod("default", name)
        uuid = response.envs["VCUDA_GPU_UUIDS"].split(",")[0]
        progress, ready = node.workdir / f"{name}.steps", node.workdir / f"{name}.ready"
        proc = node.runtime.start(
            f"default/{name}/c",
            pod_uid=admission.pod.uid,
            qos=QosClass(pod["status"]["qosClass"]),
            container_id=container_id(admission.pod.uid, "c"),
            gpu=0,
            command=[
                self.setup.python,
                str(BENCH / "gpu_workloads.py"),
                pattern,
                str(progress),
                "--ready",
                str(ready),
            ],
            envs={**dict(response.envs), "CUDA_VISIBLE_DEVICES": uuid},
            mounts=[(m.container_path, m.host_path) for m in response.mounts],
        )
        return Running(proc, progress, ready, uuid)

    def wait_ready(self, running: list[Running], timeout_s: float = 150.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(r.ready is not None and r.ready.exists() for r in running):
            for r in running:
                if r.proc.proc.poll() is not None:
                    raise RuntimeError(f"the workload of {r.proc.key} exited with {r.proc.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workloads not ready within {timeout_s:.0f} s")
            time.sleep(0.1)

    def second_column(
        self, node: Any, running: list[Running], settle: float, measure: float
    ) -> list[float | None]:
        from gpu_enforcement import sample  # noqa: PLC0415

        from agent.platform.gpu.nvml import open_nvml_backend  # noqa: PLC0415

        backend = open_nvml_backend()
        try:
            index = {g.uuid: g.index for g in backend.gpus()}
        finally:
            backend.close()
        series, _starts = sample([(r.pid, index.get(r.uuid, 0)) for r in running], settle + measure)
        skip = int(settle / WINDOW_S)
        return [sum(s[skip:]) / len(s[skip:]) if s[skip:] else None for s in series]
