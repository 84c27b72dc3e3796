"""The agent's own footprint: resident memory and CPU, idle and with containers under control.

Starts the real agent process on a simulated node with real containers
(agent/emulators/enforcednode.py: fake API server, kubelet emulator, cgroup v2 containers),
8 simulated GPUs backed by one CPU core (--sim-cores). Phase 1: no pods, ``--seconds`` idle.
Phase 2: ``--containers`` pods (16 per GPU, 6 vcuda-core each, fixed-share) whose workloads are
busy only ``--busy`` of the time (default 0.05: 128 fully busy workloads would swamp a small
machine, and the agent's cost is per container and per period, not per unit of GPU work),
then ``--seconds`` measured. The agent and its watchdog child are sampled separately from
/proc/<pid>/stat (CPU) and /proc/<pid>/status (VmRSS). Targets: RSS <= 150 MB, CPU <= 3% of
one core (the agent alone).

    .venv/bin/python bench/footprint.py [--seconds 60] [--containers 128] [--busy 0.05] [--settle 15]

Last line: RESULT rss_mb=<agent RSS under load> cpu_pct=<agent CPU under load, % of one core>.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.emulators.enforcednode import enforced_node
from agent.errors import ProcessGoneError
from agent.platform.procfs import ProcFS

HZ = os.sysconf("SC_CLK_TCK")
SPEC = "8xH100-80GB"
PER_GPU = 16
CORES = 6  # 16 x 6 = 96 vcuda-core per GPU
TARGET_RSS_MB = 150.0
TARGET_CPU_PCT = 3.0


@dataclass(frozen=True)
class Footprint:
    rss_mb: float  # at the end of the window
    peak_rss_mb: float
    cpu_pct: float  # of one core, averaged over the window


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError as err:
        raise ProcessGoneError(f"process {pid} exited") from err
    return 0.0


def is_watchdog(pid: int) -> bool:
    try:
        return b"agent.platform.watchdog" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False  # exited meanwhile (the BPF loader child)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the watchdog), from /proc/<pid>/task/*/children."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # the thread ended while we listed
    return found


def watch(pids: dict[str, int], seconds: float) -> dict[str, Footprint]:
    """Sample each process once a second over ``seconds``."""
    procfs = ProcFS()
    ticks = {name: procfs.stat(pid).cpu_ticks for name, pid in pids.items()}
    peaks = {name: rss_mb(pid) for name, pid in pids.items()}
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - started))))
        for name, pid in pids.items():
            peaks[name] = max(peaks[name], rss_mb(pid))
    elapsed = time.monotonic() - started
    return {
        name: Footprint(
            rss_mb(pid), peaks[name], 100 * (procfs.stat(pid).cpu_ticks - ticks[name]) / HZ / elapsed
        )
        for name, pid in pids.items()
    }


def report(phase: str, result: dict[str, Footprint]) -> None:
    for name, f in result.items():
        print(
            f"  {phase:<10} {name:<9} RSS {f.rss_mb:7.1f} MB (peak {f.peak_rss_mb:7.1f})"
            f"  CPU {f.cpu_pct:5.2f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="measured per phase (default 60)")
    parser.add_argument("--containers", type=int, default=128)
    parser.add_argument(
        "--settle", type=float, default=15.0, help="wait before each phase (start-up, tracer build)"
    )
    parser.add_argument("--busy", type=float, default=0.05, help="busy share of each workload (default 0.05)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-foot-", dir="/tmp"))
    try:
        with enforced_node(workdir, SPEC, agent_args=("--log-level", "WARNING")) as node:
            agent = node.agent.pid
            watchdogs = [p for p in children(agent) if is_watchdog(p)]  # not the BPF loader child
            pids = {"agent": agent} | ({"watchdog": watchdogs[0]} if watchdogs else {})
            print(
                f"{SPEC}, agent pid {agent}, watchdog {watchdogs or 'none'}; {args.seconds:.0f} s per phase"
            )
            time.sleep(args.settle)  # the tracer compiles and the caches fill first
            idle = watch(pids, args.seconds)
            report("idle", idle)
            for i in range(args.containers):
                node.run_pod(f"pod-{i}", CORES, memory_mib=1024, busy=args.busy)
            print(f"  {args.containers} containers running (busy {args.busy:.2f})")
            time.sleep(args.settle)
            loaded = watch(pids, args.seconds)
            report("loaded", loaded)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mine = loaded["agent"]
    ok = mine.peak_rss_mb <= TARGET_RSS_MB and mine.cpu_pct <= TARGET_CPU_PCT
    print(f"targets RSS <= {TARGET_RSS_MB:.0f} MB, CPU <= {TARGET_CPU_PCT:.0f}%: {'ok' if ok else 'missed'}")
    print(f"RESULT rss_mb={mine.rss_mb:.1f} cpu_pct={mine.cpu_pct:.2f}")


if __name__ == "__main__":
    main()
