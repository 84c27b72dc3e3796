"""kubelet restarts in a row against a running agent: time to re-register, and whether
threads or file descriptors grow.

Starts `vcuda-agent run --no-kube --simulate 2xH100-80GB` as a real process and the
kubelet emulator; each round restarts the emulator as kubelet restarts (sockets
deleted, kubelet.sock re-created) and waits for the agent's new registration and
device list. Target: every round under 1 s, no growth.

    .venv/bin/python bench/restarts.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import running_sim_node


def counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def registered_more_than(kubelet: KubeletEmulator, count: int) -> bool:
    return len(kubelet.registrations) > count


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-bench-", dir="/tmp"))
    try:
        with running_sim_node("2xH100-80GB", workdir) as (agent, kubelet):
            run_rounds(agent.pid, kubelet, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_rounds(agent_pid: int, kubelet: KubeletEmulator, rounds: int) -> None:
    kubelet.wait_for_plugin(timeout_s=30)
    time.sleep(0.3)
    start = counts(agent_pid)
    took: list[float] = []
    for _ in range(rounds):
        before = len(kubelet.registrations)
        began = time.monotonic()
        kubelet.restart()
        if not kubelet.wait_for(partial(registered_more_than, kubelet, before), 5.0):
            raise SystemExit("the agent did not register again within 5 s")
        kubelet.wait_for_plugin(timeout_s=5.0)
        took.append((time.monotonic() - began) * 1000)
    time.sleep(0.3)
    end = counts(agent_pid)
    took.sort()
    median = took[len(took) // 2]
    print(
        f"{rounds} kubelet restarts: re-registered and listed in median {median:.0f} ms, "
        f"max {took[-1]:.0f} ms; agent threads {start[0]} -> {end[0]}, fds {start[1]} -> {end[1]}"
    )
    print(
        f"RESULT restart_median_ms={median:.1f} restart_max_ms={took[-1]:.1f} "
        f"threads_start={start[0]} threads_end={end[0]} fds_start={start[1]} fds_end={end[1]}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
