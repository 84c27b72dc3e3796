"""How far over its GPU memory quota a growing process gets before the agent stops it,
and what the faster checks near a quota cost in agent CPU.

A simulated node (agent/emulators/enforcednode.py): the GPU server, a real ``vcuda-agent
run`` in Kubernetes mode with the emulated API server and kubelet, real container cgroups.
Per trial, a pod with ``nvidia.com/vcuda-memory: 1024`` runs a ``sim-workload`` that holds
64 MiB, then, after ``--grow-after`` seconds (longer than the short period's hold after a
container first shows up, so that hold does not help), grows by a step every few ms
(``--grow-step-mib``/``--grow-every``) toward 4096 MiB. The peak it held is the GPU
server's ground truth (the most the context ever held, read after it is gone); the action
is how it ended (SIGKILL: killed by the guard).

Rates: ``issue`` 64 MiB every 20 ms (3.2 GiB/s: 640 MiB within one 0.2 s base period, the
rate the checks near a quota are sized for; the name is kept for scripts), ``fast`` 256 MiB
every 20 ms (12.8 GiB/s: 0 to the quota in 80 ms, under one base period), ``slow`` 32 MiB
every 100 ms.
Loops, side by side on the same node (the agent restarted between them): ``new`` (the
default: 0.2 s, and 0.02 s while a container is near its quota and growing) and ``old``
(``--memory-check-near 0``: every 0.2 s, as before).

Agent CPU per loop (its own process, utime + stime from /proc, over ``--cpu-seconds``):
``steady``: ``--cpu-pods`` pods (default 4) holding 900 of 1024 MiB, still; ``near``: one
of them creeping by 1 MiB every 50 ms (near its quota and growing, so checked at the short
period throughout). ``--gpus N`` simulates N GPUs (room for 10 still pods each).

    sudo .venv/bin/python bench/quota_overshoot.py [--trials 3] [--loops new,old]
        [--rates issue,fast,slow] [--cpu-seconds 6] [--cpu-pods 4] [--gpus 1]

Last line: ``RESULT quota_overshoot_pct=<new loop, issue rate, worst trial>
quota_overshoot_old_pct=... fast_overshoot_pct=... fast_overshoot_old_pct=...
slow_overshoot_pct=... slow_overshoot_old_pct=... agent_cpu_steady_pct=...
agent_cpu_steady_old_pct=... agent_cpu_near_pct=... agent_cpu_near_old_pct=...``
(overshoot: percent of the quota held beyond it at the peak; CPU: percent of one core).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.emulators.enforcednode import EnforcedNode, enforced_node, exit_on_sigterm, wait_for

QUOTA_MIB = 1024
START_MIB = 64
GROW_TO_MIB = 4096
HZ = os.sysconf("SC_CLK_TCK")
RATES = {"issue": (64, 0.02), "fast": (256, 0.02), "slow": (32, 0.1)}
LOOPS = {"new": (), "old": ("--memory-check-near", "0")}
AGENT_ARGS = ("--log-level", "WARNING", "--device-guard", "off", "--no-ioctl-tracing")
# 1 ms of GPU every 20 ms: light, never over its 20 cores, so the freezer never holds it.
WORKLOAD = ("--kernels", "1", "--kernel-ms", "1")
# The CPU phase's pods: 10 ms every 200 ms (few requests to the GPU server, under 10 cores).
QUIET = ("--kernels", "1", "--kernel-ms", "10")


@dataclass(frozen=True)
class Trial:
    peak_mib: float
    action: str

    @property
    def over_pct(self) -> float:
        return 100 * (self.peak_mib - QUOTA_MIB) / QUOTA_MIB


def departed_peak(node: EnforcedNode, pid: int) -> int | None:
    """The most the (gone) process's context held, in bytes, from the GPU server."""
    peaks = [d["peak_memory_bytes"] for g in node.truth()["gpus"] for d in g["departed"] if d["pid"] == pid]
    return peaks[-1] if peaks else None


def trial(node: EnforcedNode, name: str, step_mib: int, every_s: float, grow_after: float) -> Trial:
    extra: tuple[str, ...] = (*WORKLOAD, "--grow-to-mib", str(GROW_TO_MIB), "--grow-after", f"{grow_after:g}")
    extra = (*extra, "--grow-step-mib", str(step_mib), "--grow-every", f"{every_s:g}")
    box = node.run_pod(name, 20, memory_mib=QUOTA_MIB, busy=0.05, workload_mib=START_MIB, extra=extra)
    growth_s = (GROW_TO_MIB - START_MIB) / step_mib * every_s
    try:
        box.proc.wait(timeout=grow_after + growth_s + 5)
    except subprocess.TimeoutExpired:  # still running at its full size
        box.proc.kill()
        box.proc.wait()
        action = "not stopped"
    else:
        rc = box.proc.returncode
        action = "killed" if rc == -signal.SIGKILL else f"exited {rc}"
    peak = wait_for(lambda: departed_peak(node, box.pid), 5, f"{name}'s context gone")
    node.node.delete_pod("default", name)
    return Trial(peak / (1 << 20), action)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def agent_cpu(node: EnforcedNode, seconds: float) -> float:
    """Percent of one core the agent process used over the next ``seconds``."""
    pid = node.agent.pid
    before, start = cpu_ticks(pid), time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_ticks(pid) - before) / HZ / (time.monotonic() - start)


def cpu_phase(node: EnforcedNode, loop: str, seconds: float, pods: int) -> tuple[float, float]:
    """(steady, near) agent CPU: ``pods`` still pods at 900 MiB, then one of them creeping."""
    creep_after = 2.0 + seconds + 1.0
    names = [f"still-{loop}-{i}" for i in range(pods - 1)]
    boxes = [
        node.run_pod(name, 10, memory_mib=QUOTA_MIB, busy=0.05, workload_mib=900, extra=QUIET)
        for name in names
    ]
    creeper_extra: tuple[str, ...] = (*QUIET, "--grow-to-mib", "1020", "--grow-after", f"{creep_after:g}")
    creeper_extra = (*creeper_extra, "--grow-step-mib", "1", "--grow-every", "0.05")
    names.append(f"creep-{loop}")
    boxes.append(
        node.run_pod(names[-1], 10, memory_mib=QUOTA_MIB, busy=0.05, workload_mib=900, extra=creeper_extra)
    )
    started = time.monotonic()
    time.sleep(2.0)  # past the short period each new container gets
    steady = agent_cpu(node, seconds)
    time.sleep(max(0.0, started + creep_after + 0.5 - time.monotonic()))
    near = agent_cpu(node, min(seconds, 5.5))  # 120 MiB at 20 MiB/s: it creeps for 6 s
    for box in boxes:
        if box.proc.poll() is not None:
            raise SystemExit(f"{box.key} exited with {box.proc.returncode} while only creeping")
        box.proc.send_signal(signal.SIGTERM)
    for box in boxes:
        box.proc.wait(timeout=20)
    for name in names:
        node.node.delete_pod("default", name)
    return steady, near


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--loops", default="new,old")
    parser.add_argument("--rates", default="issue,fast,slow")
    parser.add_argument("--grow-after", type=float, default=2.5)
    parser.add_argument("--cpu-seconds", type=float, default=6.0, help="0: no CPU phase")
    parser.add_argument("--cpu-pods", type=int, default=4, help="pods in the CPU phase (at least 1)")
    parser.add_argument("--gpus", type=int, default=1, help="simulated H100s on the node")
    args = parser.parse_args(argv)
    loops = [x for x in args.loops.split(",") if x]
    rates = [x for x in args.rates.split(",") if x]
    if not set(loops) <= set(LOOPS) or not set(rates) <= set(RATES):
        parser.error(f"loops are {sorted(LOOPS)}, rates {sorted(RATES)}")
    over: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    with (
        tempfile.TemporaryDirectory(prefix="vc-overshoot-") as tmp,
        enforced_node(Path(tmp), f"{args.gpus}xH100-80GB", agent_args=AGENT_ARGS) as node,
    ):
        for n, loop in enumerate(loops):
            if n > 0 or LOOPS[loop]:
                node.stop_agent()
                node.start_agent(*LOOPS[loop])
            for rate in rates:
                step, every = RATES[rate]
                trials = [
                    trial(node, f"grow-{loop}-{rate}-{i}", step, every, args.grow_after)
                    for i in range(args.trials)
                ]
                peaks = ", ".join(f"{t.peak_mib:.0f} MiB ({t.action})" for t in trials)
                worst = max(t.over_pct for t in trials)
                median = statistics.median(t.over_pct for t in trials)
                print(
                    f"loop {loop:3} rate {rate:5} ({step} MiB / {every * 1000:.0f} ms): peaks {peaks}; "
                    f"over quota: worst {worst:.1f} %, median {median:.1f} %",
                    flush=True,
                )
                over[loop, rate] = worst
            if args.cpu_seconds > 0:
                steady, near = cpu_phase(node, loop, args.cpu_seconds, max(1, args.cpu_pods))
                print(f"loop {loop:3} agent CPU: steady {steady:.2f} %, near and growing {near:.2f} %")
                cpu[loop, "steady"], cpu[loop, "near"] = steady, near
    keys = {"issue": "quota_overshoot", "fast": "fast_overshoot", "slow": "slow_overshoot"}
    fields = [
        f"{keys[rate]}{'' if loop == 'new' else '_' + loop}_pct={over[loop, rate]:.1f}"
        for rate in rates
        for loop in loops
    ]
    fields += [
        f"agent_cpu_{what}{'' if loop == 'new' else '_' + loop}_pct={cpu[loop, what]:.2f}"
        for what in ("steady", "near")
        for loop in loops
        if (loop, what) in cpu
    ]
    print("RESULT " + " ".join(fields))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops what it started
    raise SystemExit(main())
