"""The agent's own footprint: resident memory and CPU, idle and with containers under control.

Starts the real agent process on a simulated node with real containers
(agent/emulators/enforcednode.py: fake API server, kubelet emulator, cgroup v2 containers)
and 8 simulated GPUs served by the GPU engine process (``vcuda-agent sim-gpu``). Phase 1: no
pods, ``--seconds`` idle. Phase 2: ``--containers`` pods (16 per GPU, 6 vcuda-core each,
fixed-share) whose ``train`` workloads keep their GPU as busy as ``--busy`` (default 1: every
container is over its cap and throttled every cycle, the agent's worst case), then
``--seconds`` measured. The agent, its watchdog child, the GPU engine and the workloads (all
together) are sampled apart from /proc/<pid>/stat (CPU) and /proc/<pid>/status (VmRSS).
Targets: RSS <= 150 MB, CPU <= 3% of one core (the agent alone).

    .venv/bin/python bench/footprint.py [--seconds 60] [--containers 128] [--busy 1] [--settle 15]

Last line: ``RESULT rss_mb=<agent RSS under load> cpu_pct=<agent CPU under load, % of one core>
engine_cpu_pct=<the GPU engine's> workloads_cpu_pct=<all workloads'>``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.emulators.enforcednode import enforced_node, exit_on_sigterm
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


def group_ticks(procfs: ProcFS, pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += procfs.stat(pid).cpu_ticks
        except ProcessGoneError:
            continue
    return total


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Each thread of ``pid``: (its kernel name, CPU ticks so far); supervised loops are named
    after their task (agent/platform/threadname.py)."""
    found: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            found[int(task.name)] = (comm, int(fields[11]) + int(fields[12]))  # utime + stime
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # the thread ended while we read it
    return found


def thread_report(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], elapsed: float
) -> None:
    """The agent's CPU per thread name over the window, largest first."""
    by_name: dict[str, float] = {}
    for tid, (comm, ticks) in after.items():
        start = before.get(tid, (comm, 0))[1] if tid in before else 0
        by_name[comm] = by_name.get(comm, 0.0) + 100 * (ticks - start) / HZ / elapsed
    shown = sorted(by_name.items(), key=lambda item: -item[1])
    print("    agent threads: " + ", ".join(f"{name} {pct:.2f}%" for name, pct in shown if pct >= 0.05))


def watch(pids: dict[str, int], seconds: float, group: list[int] | None = None) -> dict[str, Footprint]:
    """Sample each process once a second over ``seconds``; ``group`` (the workloads) is
    reported as one, CPU only."""
    procfs = ProcFS()
    threads = thread_ticks(pids["agent"])
    ticks = {name: procfs.stat(pid).cpu_ticks for name, pid in pids.items()}
    group_start = group_ticks(procfs, group or [])
    peaks = {name: rss_mb(pid) for name, pid in pids.items()}
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - started))))
        for name, pid in pids.items():
            peaks[name] = max(peaks[name], rss_mb(pid))
    elapsed = time.monotonic() - started
    thread_report(threads, thread_ticks(pids["agent"]), elapsed)
    found = {
        name: Footprint(
            rss_mb(pid), peaks[name], 100 * (procfs.stat(pid).cpu_ticks - ticks[name]) / HZ / elapsed
        )
        for name, pid in pids.items()
    }
    if group:
        cpu = 100 * (group_ticks(procfs, group) - group_start) / HZ / elapsed
        found[f"{len(group)} workloads"] = Footprint(0.0, 0.0, cpu)
    return found


def report(phase: str, result: dict[str, Footprint]) -> None:
    for name, f in result.items():
        print(
            f"  {phase:<10} {name:<14} RSS {f.rss_mb:7.1f} MB (peak {f.peak_rss_mb:7.1f})"
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
    parser.add_argument("--busy", type=float, default=1.0, help="busy share of each workload (default 1)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-foot-", dir="/tmp"))
    try:
        with enforced_node(workdir, SPEC, agent_args=("--log-level", "WARNING")) as node:
            agent = node.agent.pid
            watchdogs = [p for p in children(agent) if is_watchdog(p)]  # not the BPF loader child
            pids = {"agent": agent} | ({"watchdog": watchdogs[0]} if watchdogs else {})
            assert node.gpu_server is not None
            pids["GPU engine"] = node.gpu_server.pid
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
            loaded = watch(pids, args.seconds, [c.pid for c in node.runtime.containers])
            report("loaded", loaded)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mine = loaded["agent"]
    ok = mine.peak_rss_mb <= TARGET_RSS_MB and mine.cpu_pct <= TARGET_CPU_PCT
    print(f"targets RSS <= {TARGET_RSS_MB:.0f} MB, CPU <= {TARGET_CPU_PCT:.0f}%: {'ok' if ok else 'missed'}")
    workloads = next(f for name, f in loaded.items() if name.endswith("workloads"))
    print(
        f"RESULT rss_mb={mine.rss_mb:.1f} cpu_pct={mine.cpu_pct:.2f} "
        f"engine_cpu_pct={loaded['GPU engine'].cpu_pct:.2f} workloads_cpu_pct={workloads.cpu_pct:.2f}"
    )


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops what it started
    main()
