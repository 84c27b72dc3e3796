"""What the compute-cap controller costs: 8 GPUs x 16 containers at the default period.

Every container is kept busy above its cap (5 % of a GPU each), so all 128 are throttled
every period: the worst case, two actuator calls per container per period. The enforcer's
loop runs in this process for ``--seconds``; its CPU time is read with
``time.process_time()``. Side by side in one run:

- ``recording``: the controller alone, on a synthetic sample source (the actuator only
  records calls);
- ``freezer``: the same, with the real freezer on 128 real, empty cgroup v2 directories;
- ``engine``: the GPU engine (``vcuda-agent sim-gpu``, its own process) with 128 real
  ``train`` workloads, each in its cgroup, read through the simulated backend (as the agent
  reads NVML: batched polls of samples, utilization, memory) and held by the real freezer.
  This process's CPU is the controller plus its backend reads; the engine's and the
  workloads' are read from /proc apart (root and cgroup v2 only, as ``freezer``).

RSS is this process's, before and after building the controller for 128 containers.

    sudo .venv/bin/python bench/controller_cost.py [--seconds 20]

Last line: ``RESULT controller_cpu_pct=... rss_mb=... engine_cpu_pct=...
workloads_cpu_pct=...`` (controller: the engine variant's CPU when it ran, else the
recording one's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from agent.control.actuators import Actuator, FreezerActuator, ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.control.usagemeter import SampleSource
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.emulators.containers import remove_cgroup_dir
from agent.emulators.enforcednode import NODE, exit_on_sigterm, start_gpu_server, stop_process
from agent.errors import ProcessGoneError
from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.freezejournal import FreezeJournal
from agent.platform.gpu.inventory import DeviceSample, ProcessSample
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.procfs import ProcFS
from agent.settings import EnforcementSettings

HZ = os.sysconf("SC_CLK_TCK")
GPUS = 8
PER_GPU = 16
CAP = 5  # 16 containers at 6.25 % each: every one over its cap (+1 pp), held


class SyntheticSamples:
    """A sampling driver every 0.2 s: one per-process sample per tick, crediting the process
    resident at that instant (the GPU's containers in turn) with 60 % SM activity, as the
    driver's perfmon ring does (docs/gpu-model.md); the device busy throughout (every
    container over its cap, whoever is thawed: the worst case). (It credited every process
    at every tick until 2026-12-02: 16 times the driver's per-process samples.)"""

    def __init__(self) -> None:
        self.pids = {g: [1000 + g * PER_GPU + i for i in range(PER_GPU)] for g in range(GPUS)}

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        tick = int(time.time() * 5)  # a new driver tick every 0.2 s
        first = max(tick - 71, since_us // 200_000 + 1)  # the ring keeps 72
        pids = self.pids[index]
        return [ProcessSample(pids[t % len(pids)], t * 200_000, 60) for t in range(first, tick + 1)]

    def device_utilization(self, index: int) -> int:
        return 100

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        now_us = int(time.time() * 5) * 200_000
        return [DeviceSample(now_us, 100)] if now_us > since_us else []

    def sample_period_s(self, index: int) -> float | None:
        return 0.2


class RecordingActuator:
    name = "recording"

    def __init__(self) -> None:
        self.calls = 0

    def freeze(self, target: ThrottleTarget) -> None:
        self.calls += 1

    def thaw(self, target: ThrottleTarget) -> None:
        self.calls += 1

    def release(self, target: ThrottleTarget) -> None:
        self.calls += 1

    def release_all(self) -> None:
        self.calls += 1


def spec(gpu: int, i: int) -> EnforcementSpec:
    return EnforcementSpec(
        pod_uid=f"pod-{gpu}-{i}",
        namespace="bench",
        pod=f"p{gpu}-{i}",
        container="c",
        container_id=f"c{gpu}-{i}",
        runtime="containerd",
        qos_class="BestEffort",
        gpus=(gpu,),
        cores=CAP,
        cap=CAP,
        memory_quota_mib=256,
        policy=Policy.FIXED_SHARE,
    )


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(
    actuator: Actuator,
    dirs: dict[str, Path] | None,
    seconds: float,
    source: SampleSource | None = None,
    owners: dict[int, ContainerRef] | None = None,
) -> tuple[float, int, float]:
    """(CPU % of one core, periods, RSS MB added by the controller)."""
    specs = [spec(g, i) for g in range(GPUS) for i in range(PER_GPU)]
    if source is None:
        synthetic = SyntheticSamples()
        source = synthetic
        owners = {
            pid: ContainerRef(f"pod-{g}-{i}", f"c{g}-{i}")
            for g in range(GPUS)
            for i, pid in enumerate(synthetic.pids[g])
        }
    assert owners is not None

    def locate(s: EnforcementSpec) -> ThrottleTarget:
        cgroup = dirs[s.container_id] if dirs else None
        return ThrottleTarget(s.label, cgroup, cgroup / "cgroup.procs" if cgroup else None)

    before = rss_mb()
    defaults = EnforcementSettings()
    enforcer = Enforcer(
        gpus=range(GPUS),
        samples=source,
        specs=lambda: specs,
        owner_of=owners.get,
        locate=locate,
        actuator=actuator,
        period_s=defaults.period_s,
    )
    stop = threading.Event()
    worker = threading.Thread(target=enforcer.run, args=(stop,))
    cpu_start, wall_start = time.process_time(), time.monotonic()
    worker.start()
    time.sleep(seconds)
    stop.set()
    worker.join()
    cpu = time.process_time() - cpu_start
    wall = time.monotonic() - wall_start
    return 100 * cpu / wall, enforcer.stats.periods, rss_mb() - before


def cpu_ticks(pids: list[int]) -> int:
    procfs = ProcFS()
    total = 0
    for pid in pids:
        with contextlib.suppress(ProcessGoneError):
            total += procfs.stat(pid).cpu_ticks
    return total


def run_engine(dirs: dict[str, Path], seconds: float, workdir: Path) -> tuple[float, float, float]:
    """(controller %, engine %, workloads %) with the GPU engine and 128 real workloads."""
    sim = workdir / "sim"
    server = start_gpu_server(f"{GPUS}xH100-80GB", sim, workdir / "gpu.log")
    workloads: list[subprocess.Popen[bytes]] = []
    backend: SimulatedBackend | None = None
    try:
        owners = {}
        for g in range(GPUS):
            for i in range(PER_GPU):
                cmd = [
                    sys.executable,
                    "-m",
                    "agent",
                    "sim-workload",
                    "--sim-state-dir",
                    str(sim),
                    "--gpu",
                    str(g),
                ]
                procs = dirs[f"c{g}-{i}"] / "cgroup.procs"
                proc = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *cmd])
                workloads.append(proc)
                owners[proc.pid] = ContainerRef(f"pod-{g}-{i}", f"c{g}-{i}")
        backend = SimulatedBackend(f"{GPUS}xH100-80GB", NODE, sim)
        time.sleep(3)  # the workloads open their contexts
        pids = [p.pid for p in workloads]
        engine_start, workloads_start, started = cpu_ticks([server.pid]), cpu_ticks(pids), time.monotonic()
        journal = FreezeJournal(workdir / "state" / "frozen.json")
        controller, _, _ = run(FreezerActuator(journal), dirs, seconds, backend, owners)
        elapsed = time.monotonic() - started
        engine = 100 * (cpu_ticks([server.pid]) - engine_start) / HZ / elapsed
        busy = 100 * (cpu_ticks(pids) - workloads_start) / HZ / elapsed
        return controller, engine, busy
    finally:
        if backend is not None:
            backend.close()
        for proc in workloads:
            proc.kill()
            proc.wait()
        stop_process(server)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    start_rss = rss_mb()
    recording = RecordingActuator()
    cpu, periods, added = run(recording, None, args.seconds)
    per_container = recording.calls / (GPUS * PER_GPU * max(periods, 1))
    print(
        f"recording actuator: {cpu:.2f} % of one core, {periods} periods, "
        f"{per_container:.1f} actuator calls per container per period, RSS +{added:.1f} MB"
    )
    result_cpu, extra = cpu, ""
    layout = detect_layout()
    if layout.v2_root is not None:
        root = layout.v2_root / f"vcuda-bench-{secrets.token_hex(4)}"
        root.mkdir()
        dirs = {f"c{g}-{i}": root / f"c{g}-{i}" for g in range(GPUS) for i in range(PER_GPU)}
        journal_dir = Path("/tmp") / root.name
        try:
            for d in dirs.values():
                d.mkdir()
            freezer_cpu, periods, _ = run(
                FreezerActuator(FreezeJournal(journal_dir / "frozen.json")), dirs, args.seconds
            )
            print(f"freezer on {len(dirs)} real cgroups: {freezer_cpu:.2f} % of one core, {periods} periods")
            controller, engine, busy = run_engine(dirs, args.seconds, journal_dir)
            print(
                f"GPU engine with {len(dirs)} train workloads: controller + backend reads "
                f"{controller:.2f} %, engine {engine:.2f} %, workloads {busy:.2f} % (together) of one core"
            )
            result_cpu, extra = controller, f" engine_cpu_pct={engine:.2f} workloads_cpu_pct={busy:.2f}"
        finally:
            for d in dirs.values():
                remove_cgroup_dir(d)
            root.rmdir()
            shutil.rmtree(journal_dir, ignore_errors=True)
    print(f"process RSS {rss_mb():.1f} MB (at start {start_rss:.1f} MB)")
    print(f"RESULT controller_cpu_pct={result_cpu:.2f} rss_mb={rss_mb():.1f}{extra}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops what it started
    raise SystemExit(main())
