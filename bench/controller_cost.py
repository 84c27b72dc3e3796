"""What the compute-cap controller costs: 8 GPUs x 16 containers at the default period.

A synthetic sample source reports every container busy above its cap (6 % of a GPU each),
so all 128 are throttled every period: the worst case, two actuator calls per container
per period. The enforcer's loop runs in this process for ``--seconds``; its CPU time is
read with ``time.process_time()``. Side by side in one run:

- ``recording``: the controller alone (the actuator only records calls);
- ``freezer``: the real freezer on 128 real, empty cgroup v2 directories (root only).

RSS is this process's, before and after building the controller for 128 containers.

    sudo .venv/bin/python bench/controller_cost.py [--seconds 20]

Last line: ``RESULT controller_cpu_pct=... rss_mb=...`` (the freezer variant's CPU when it
ran, else the recording one's).
"""

from __future__ import annotations

import argparse
import secrets
import threading
import time
from pathlib import Path

from agent.control.actuators import Actuator, FreezerActuator, ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.freezejournal import FreezeJournal
from agent.platform.gpu.inventory import ProcessSample
from agent.settings import EnforcementSettings

GPUS = 8
PER_GPU = 16
CAP = 6


class SyntheticSamples:
    """Each container's process at 10 % every 0.2 s, like a sampling driver."""

    def __init__(self) -> None:
        self.pids = {g: [1000 + g * PER_GPU + i for i in range(PER_GPU)] for g in range(GPUS)}

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        now_us = int(time.time() * 5) * 200_000  # a new driver tick every 0.2 s
        if now_us <= since_us:
            return []
        return [ProcessSample(pid, now_us, 10) for pid in self.pids[index]]

    def device_utilization(self, index: int) -> int:
        return 10 * PER_GPU

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


def run(actuator: Actuator, dirs: dict[str, Path] | None, seconds: float) -> tuple[float, int, float]:
    """(CPU % of one core, periods, RSS MB added by the controller)."""
    source = SyntheticSamples()
    specs = [spec(g, i) for g in range(GPUS) for i in range(PER_GPU)]
    owners = {
        pid: ContainerRef(f"pod-{g}-{i}", f"c{g}-{i}")
        for g in range(GPUS)
        for i, pid in enumerate(source.pids[g])
    }

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
    result_cpu = cpu
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
            result_cpu = freezer_cpu
        finally:
            for d in dirs.values():
                d.rmdir()
            root.rmdir()
            for f in journal_dir.glob("*"):
                f.unlink()
            journal_dir.rmdir()
    print(f"process RSS {rss_mb():.1f} MB (at start {start_rss:.1f} MB)")
    print(f"RESULT controller_cpu_pct={result_cpu:.2f} rss_mb={rss_mb():.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
