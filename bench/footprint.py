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

    .venv/bin/python bench/footprint.py [--seconds 60] [--containers 128] [--busy 1] [--settle 15] [--parts]
        [--agent-arg ARG ...]

Last line: ``RESULT rss_mb=<agent RSS under load> cpu_pct=<agent CPU under load, % of one core>
engine_cpu_pct=<the GPU engine's> workloads_cpu_pct=<all workloads'> throttled=<containers held at the
window's end> freezes_per_s=<all containers'> mean_use_pct=<a container's real share of its GPU>
wakeups_per_s=<the agent's threads' sleeps that ended> wakeup_us=<CPU one costs on this machine>``:
throttled, freezes_per_s and mean_use_pct say the agent did its work (at ``--busy 1`` every
container is held, and a line says so when one is not); the last two say how much of the
figure is the machine's price of waking a thread (measured before the agent starts), which on
a VM changes from hour to hour.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agent.emulators.enforcednode import EnforcedNode, enforced_node, exit_on_sigterm
from agent.errors import ProcessGoneError
from agent.platform.procfs import ProcFS

HZ = os.sysconf("SC_CLK_TCK")
PARTS_DIR = Path(__file__).resolve().parent / "parts"  # its sitecustomize times these (--parts)
PARTS = (
    "agent.control.enforcer:Enforcer.period",
    "agent.control.enforcer:Enforcer._act",
    "agent.control.turnloop:TurnLoop.due",
    "agent.control.turnloop:TurnLoop._decide",
    "agent.control.turnloop:next_turn",
    "agent.control.enforcer:Enforcer._freeze",
    "agent.control.enforcer:Enforcer._thaw",
    "agent.control.turnloop:TurnLoop.read",
    "agent.control.turnmeter:TurnMeter._attribute",
    "agent.control.turnmeter:TurnMeter._apply_credits",
    "agent.control.enforcer:Enforcer._control",
    "agent.surfaces.memorynode:MemoryIntegration.check_once",
    "agent.surfaces.memorynode:MemoryIntegration._traced",
    "agent.platform.gpu.guarded:GuardedBackend.process_memory",
    "agent.control.specbook:SpecBook.specs",
    "agent.control.deviceguard:DeviceGuard._apply",
    "agent.platform.gpu.sim.backend:SimulatedBackend._refresh",
)
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
    wakeups_per_s: float = 0.0  # the agent's: its threads' voluntary context switches


WAKEUP_THREADS = 4
WAKEUP_PERIOD_S = 0.01


def wakeup_cost_us(seconds: float = 2.0) -> float:
    """CPU microseconds this machine spends on one thread wakeup (a timed Event.wait that
    times out, as the agent's loops wait), measured in this process over ``seconds``: on a VM
    a wakeup is a timer exit or an IPI, and it is most of what an idle-looking agent costs."""
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.wait(WAKEUP_PERIOD_S):
            pass

    sleepers = [threading.Thread(target=sleeper) for _ in range(WAKEUP_THREADS)]
    cpu, started = time.process_time(), time.monotonic()
    for thread in sleepers:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in sleepers:
        thread.join()
    elapsed = time.monotonic() - started
    return 1e6 * (time.process_time() - cpu) / (WAKEUP_THREADS * elapsed / WAKEUP_PERIOD_S)


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads so far (each one a sleep that ended)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we read it
    return total


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


def thread_ticks(pid: int) -> dict[int, tuple[str, int, int]]:
    """Each thread of ``pid``: (its kernel name, CPU ticks so far, wakeups so far); supervised
    loops are named after their task (agent/platform/threadname.py)."""
    found: dict[int, tuple[str, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            woke = next(
                int(line.split()[1])
                for line in (task / "status").read_text().splitlines()
                if line.startswith("voluntary_ctxt_switches:")
            )
            found[int(task.name)] = (comm, int(fields[11]) + int(fields[12]), woke)  # utime + stime
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError, StopIteration):
            continue  # the thread ended while we read it
    return found


def thread_report(
    before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]], elapsed: float
) -> None:
    """The agent's CPU and wakeups per thread name over the window, largest first."""
    cpu: dict[str, float] = {}
    woke: dict[str, float] = {}
    for tid, (comm, ticks, switches) in after.items():
        _, ticks_before, switches_before = before.get(tid, (comm, 0, 0))
        cpu[comm] = cpu.get(comm, 0.0) + 100 * (ticks - ticks_before) / HZ / elapsed
        woke[comm] = woke.get(comm, 0.0) + (switches - switches_before) / elapsed
    shown = sorted(cpu, key=lambda name: (-cpu[name], -woke[name]))
    print(
        "    agent threads (CPU %, wakeups/s): "
        + ", ".join(
            f"{name} {cpu[name]:.2f}% {woke[name]:.0f}/s"
            for name in shown
            if cpu[name] >= 0.05 or woke[name] >= 1
        )
    )


def watch(pids: dict[str, int], seconds: float, group: list[int] | None = None) -> dict[str, Footprint]:
    """Sample each process once a second over ``seconds``; ``group`` (the workloads) is
    reported as one, CPU only."""
    procfs = ProcFS()
    threads, woke = thread_ticks(pids["agent"]), wakeups(pids["agent"])
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
    woke_per_s = (wakeups(pids["agent"]) - woke) / elapsed
    found = {
        name: Footprint(
            rss_mb(pid),
            peaks[name],
            100 * (procfs.stat(pid).cpu_ticks - ticks[name]) / HZ / elapsed,
            woke_per_s if name == "agent" else 0.0,
        )
        for name, pid in pids.items()
    }
    if group:
        cpu = 100 * (group_ticks(procfs, group) - group_start) / HZ / elapsed
        found[f"{len(group)} workloads"] = Footprint(0.0, 0.0, cpu)
    return found


@dataclass(frozen=True)
class Control:
    """What the agent did to the containers over the loaded window: the figure is only the
    worst case if every container was held and frozen and thawed all along."""

    throttled: int  # containers with a target at the window's end
    freezes_per_s: float  # all containers together
    mean_use_pct: float  # each container's real share of its GPU, from the engine's truth
    max_use_pct: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def control_figures(metrics: str) -> tuple[int, float]:
    """(containers with a target now, their freezes so far) from the agent's /metrics."""
    throttled, freezes = 0, 0.0
    for family in text_string_to_metric_families(metrics):
        if family.name == "vcuda_container_target_ratio":
            throttled = len(family.samples)
        elif family.name == "vcuda_container_throttle_actions":
            freezes = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return throttled, freezes


def watch_control(
    node: EnforcedNode, port: int, seconds: float, pids: dict[str, int]
) -> tuple[dict[str, Footprint], Control]:
    """:func:`watch` the processes, and read what the agent did to the containers meanwhile."""
    boxes = node.runtime.containers
    _, freezes_before = control_figures(scrape(port))
    ran_before, started = node.gpu_seconds(boxes), time.monotonic()
    found = watch(pids, seconds, [c.pid for c in boxes])
    ran_after, elapsed = node.gpu_seconds(boxes), time.monotonic() - started
    throttled, freezes_after = control_figures(scrape(port))
    use = [100 * (a - b) / elapsed for a, b in zip(ran_after, ran_before, strict=True)]
    return found, Control(
        throttled, (freezes_after - freezes_before) / elapsed, sum(use) / len(use), max(use)
    )


def report(phase: str, result: dict[str, Footprint], wakeup_us: float) -> None:
    for name, f in result.items():
        print(
            f"  {phase:<10} {name:<14} RSS {f.rss_mb:7.1f} MB (peak {f.peak_rss_mb:7.1f})"
            f"  CPU {f.cpu_pct:5.2f}%"
        )
    agent = result["agent"]
    share = agent.wakeups_per_s * wakeup_us / 1e4  # % of a core
    print(
        f"  {phase:<10} agent wakeups {agent.wakeups_per_s:.0f}/s: about {share:.2f}% of a core"
        " at this machine's cost of one"
    )


def print_parts(parts_file: Path) -> None:
    """The agent's thread CPU per timed function over the loaded window (bench/parts/)."""
    deadline = time.monotonic() + 10
    while not parts_file.exists():
        if time.monotonic() > deadline:
            print("    parts: the agent wrote none (was bench/parts/ on its PYTHONPATH?)")
            return
        time.sleep(0.05)
    print("    agent parts (thread CPU ms/s, calls/s, us/call; nested parts count in their callers too):")
    for line in parts_file.read_text().splitlines():
        path, ms, per_s = line.split()
        us = 1000 * float(ms) / max(float(per_s), 1e-9)
        print(f"      {path:<36} {float(ms):7.2f} {float(per_s):8.1f} {us:9.1f}")


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
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also print the thread CPU of the agent's main functions over the loaded window (bench/parts/)",
    )
    parser.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of `vcuda-agent run` (repeat it: --agent-arg=--memory-check --agent-arg=1), "
        "to compare a setting's cost side by side",
    )
    args = parser.parse_args()
    wakeup_us = wakeup_cost_us()
    print(f"this machine: one thread wakeup costs {wakeup_us:.1f} us of CPU")
    workdir = Path(tempfile.mkdtemp(prefix="vc-foot-", dir="/tmp"))
    parts_file = workdir / "parts.txt"
    if args.parts:  # inherited by the agent's process (and ignored by the others)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PARTS_DIR), os.environ.get("PYTHONPATH")])
        )
        os.environ["VCUDA_PARTS"], os.environ["VCUDA_PARTS_OUT"] = ",".join(PARTS), str(parts_file)
    try:
        port = free_port()
        agent_args = ("--log-level", "WARNING", "--metrics-address", f"127.0.0.1:{port}", *args.agent_arg)
        with enforced_node(workdir, SPEC, agent_args=agent_args) as node:
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
            report("idle", idle, wakeup_us)
            for i in range(args.containers):
                node.run_pod(f"pod-{i}", CORES, memory_mib=1024, busy=args.busy)
            print(f"  {args.containers} containers running (busy {args.busy:.2f})")
            time.sleep(args.settle)
            if args.parts:
                os.kill(agent, signal.SIGUSR1)  # the parts' window starts with the measured one
            loaded, control = watch_control(node, port, args.seconds, pids)
            if args.parts:
                os.kill(agent, signal.SIGUSR2)
                print_parts(parts_file)
            report("loaded", loaded, wakeup_us)
            print(
                f"  held: {control.throttled} of {args.containers} containers throttled, "
                f"{control.freezes_per_s:.1f} freezes/s; each ran {control.mean_use_pct:.1f} % of its GPU "
                f"on average (at most {control.max_use_pct:.1f}; cap {CORES})"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mine = loaded["agent"]
    ok = mine.peak_rss_mb <= TARGET_RSS_MB and mine.cpu_pct <= TARGET_CPU_PCT
    worst_case = args.busy < 1 or control.throttled == args.containers
    print(f"targets RSS <= {TARGET_RSS_MB:.0f} MB, CPU <= {TARGET_CPU_PCT:.0f}%: {'ok' if ok else 'missed'}")
    if not worst_case:
        print(f"not the worst case: only {control.throttled} of {args.containers} containers were throttled")
    workloads = next(f for name, f in loaded.items() if name.endswith("workloads"))
    print(
        f"RESULT rss_mb={mine.rss_mb:.1f} cpu_pct={mine.cpu_pct:.2f} "
        f"engine_cpu_pct={loaded['GPU engine'].cpu_pct:.2f} workloads_cpu_pct={workloads.cpu_pct:.2f} "
        f"throttled={control.throttled} freezes_per_s={control.freezes_per_s:.1f} "
        f"mean_use_pct={control.mean_use_pct:.1f} "
        f"wakeups_per_s={mine.wakeups_per_s:.0f} wakeup_us={wakeup_us:.1f}"
    )


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops what it started
    main()
