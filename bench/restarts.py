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
import signal
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import sim_agent_command


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
    kubelet = KubeletEmulator(workdir / "dp")
    kubelet.start()
    cmd = sim_agent_command("2xH100-80GB", workdir / "dp", workdir / "sim", metrics_address=None)
    agent = subprocess.Popen([*cmd, "--log-level", "WARNING"])
    try:
        kubelet.wait_for_plugin(timeout_s=30)
        time.sleep(0.3)
        start = counts(agent.pid)
        took: list[float] = []
        for _ in range(args.rounds):
            before = len(kubelet.registrations)
            began = time.monotonic()
            kubelet.restart()
            if not kubelet.wait_for(partial(registered_more_than, kubelet, before), 5.0):
                raise SystemExit("the agent did not register again within 5 s")
            kubelet.wait_for_plugin(timeout_s=5.0)
            took.append((time.monotonic() - began) * 1000)
        time.sleep(0.3)
        end = counts(agent.pid)
        took.sort()
        median = took[len(took) // 2]
        print(
            f"{args.rounds} kubelet restarts: re-registered and listed in median {median:.0f} ms, "
            f"max {took[-1]:.0f} ms; agent threads {start[0]} -> {end[0]}, fds {start[1]} -> {end[1]}"
        )
        print(
            f"RESULT restart_median_ms={took[len(took) // 2]:.1f} restart_max_ms={took[-1]:.1f} "
            f"threads_start={start[0]} threads_end={end[0]} fds_start={start[1]} fds_end={end[1]}"
        )
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        kubelet.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
