"""The memory guard in kill mode against real processes on a simulated GPU node.

Two real workloads share simulated GPU 0: a neighbour at 512 MiB and a grower that
declares 800 MiB, then 1500 MiB after 1 s, with a 1024 MiB quota. The guard, checked every
0.2 s as the agent runs it, must SIGKILL the grower (through a pidfd, after the pid + start
time check) within 1 s of the growth, record the Event, and leave the neighbour alone.

Then the agent's own loop (a real ``vcuda-agent run`` on an emulated node) against a pod
that grows 64 MiB every 20 ms toward 4096 MiB on a 1024 MiB quota (checked only every 0.2 s,
it once reached 1472 MiB). Near its quota and growing, it is checked every 10 ms: on an idle machine
it is killed one step over (1088 MiB, 6.25 %); the bound here is 4 steps (25 %), which a
loaded 2-core machine's scheduling delays stay within and the old fixed 0.2 s period (up to
640 MiB per period at this rate) does not. That it is checked at the short period once near
its quota is tested in virtual time (tests/unit/test_memcadence.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.clock import SystemClock
from agent.control.memguard import EVENT_REASON, MemoryGuard, MemoryView, process_uses
from agent.domain.memquota import MIB, ProcessUse
from agent.emulators.enforcednode import enforced_node, wait_for
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.kube.pods import PodInfo
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.settings import MemoryQuotaMode
from tests.integration.cgroup_trees import real_layout

CHECK_S = 0.2
QUOTA_MIB = 1024
GROWER_POD = PodInfo(uid="u-grower", namespace="ns", name="grower")
NEIGHBOUR_POD = PodInfo(uid="u-neighbour", namespace="ns", name="neighbour")

CLI = str(Path(sys.executable).with_name("vcuda-agent"))  # the installed console script


@dataclass
class Events:
    pods: list[tuple[PodInfo, str, str]] = field(default_factory=list)

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        self.pods.append((pod, reason, message))

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        raise AssertionError("the memory guard emits pod Events only")


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    sim = SimulatedBackend("1xH100-80GB", "quota-node", short_dir / "sim")
    yield sim
    sim.close()


def workload(sim: SimulatedBackend, *args: str) -> subprocess.Popen[bytes]:
    cmd = [CLI, "sim-workload", "--sim-state-dir", str(sim.root.root), "--gpu", "0", "--busy", "0.05"]
    return subprocess.Popen([*cmd, *args])


def registered_mib(sim: SimulatedBackend, pid: int) -> int | None:
    """What the GPU says the process holds (NVML's per-process memory)."""
    return next((m.used_bytes // MIB for m in sim.process_memory(0) if m.pid == pid), None)


def wait_registered(sim: SimulatedBackend, *pids: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(registered_mib(sim, pid) is not None for pid in pids):
            return
        time.sleep(0.02)
    raise AssertionError(f"workloads {pids} hold no GPU memory: {sim.process_memory(0)}")


def views(sim: SimulatedBackend, procfs: ProcFS, grower: int, neighbour: int) -> list[MemoryView]:
    """Each workload is its own container; processes are grouped by pid (no cgroups here)."""
    uses = process_uses(sim.process_memory(0), procfs)
    return [
        MemoryView("ns/grower/main", GROWER_POD, QUOTA_MIB, [u for u in uses if u.pid == grower]),
        MemoryView("ns/neighbour/main", NEIGHBOUR_POD, QUOTA_MIB, [u for u in uses if u.pid == neighbour]),
    ]


def test_the_grower_is_killed_within_a_second_and_the_neighbour_is_untouched(
    backend: SimulatedBackend,
) -> None:
    procfs = ProcFS()
    neighbour = workload(backend, "--memory-mib", "512")
    wait_registered(backend, neighbour.pid)
    grower = workload(backend, "--memory-mib", "800", "--grow-to-mib", "1500", "--grow-after", "1")
    try:
        wait_registered(backend, grower.pid)
        neighbour_identity = procfs.identity(neighbour.pid)
        assert registered_mib(backend, grower.pid) == 800
        events = Events()
        guard = MemoryGuard(
            mode=MemoryQuotaMode.KILL, procfs=procfs, clock=SystemClock(), events=events, own_pid=os.getpid()
        )
        grown_at = killed_at = None
        next_check = time.monotonic()
        deadline = time.monotonic() + 8.0
        while killed_at is None and time.monotonic() < deadline:
            now = time.monotonic()
            if grown_at is None and registered_mib(backend, grower.pid) == 1500:
                grown_at = now
            if now >= next_check:
                next_check += CHECK_S
                actions = guard.check(views(backend, procfs, grower.pid, neighbour.pid))
                if grown_at is None:
                    assert actions == [], "killed before it grew"
                if any(a.action == f"killed pid {grower.pid}" for a in actions):
                    killed_at = time.monotonic()
            time.sleep(0.01)
        assert grown_at is not None, "the grower never declared 1500 MiB"
        assert killed_at is not None, f"not killed; actions: {list(guard.recent_actions)}"
        assert killed_at - grown_at <= 1.0, f"killed {killed_at - grown_at:.2f} s after growing"
        assert grower.wait(timeout=5) == -signal.SIGKILL
        # The Event, once, on the grower's pod.
        assert len(events.pods) == 1
        pod, reason, message = events.pods[0]
        assert pod is GROWER_POD and reason == EVENT_REASON
        assert f"pid {grower.pid} (1500 MiB)" in message and "1024 MiB" in message
        assert guard.stats() == {"kills": 1, "audits": 0, "skipped": 0}
        # The neighbour: same process, still running, still declaring 512 MiB, never judged over.
        assert neighbour.poll() is None
        assert procfs.is_alive(neighbour_identity)
        assert registered_mib(backend, neighbour.pid) == 512
        for _ in range(3):  # and later checks leave it alone
            time.sleep(CHECK_S)
            assert guard.check(views(backend, procfs, grower.pid, neighbour.pid)) == []
        assert neighbour.poll() is None
    finally:
        for proc in (grower, neighbour):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)


def start_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"])


def test_a_reused_or_mismatched_pid_of_a_real_process_is_not_killed() -> None:
    procfs = ProcFS()
    first = start_sleeper()
    old = procfs.identity(first.pid)
    first.kill()
    first.wait()
    time.sleep(0.05)  # a later clock tick: the next process has a different start time
    second = start_sleeper()
    try:
        live = procfs.identity(second.pid)
        assert live.start_ticks != old.start_ticks
        # The pid that was measured with the old start time: either the pid really was reused,
        # or (usually) the live pid paired with the old start time, as if it had been.
        measured = old if second.pid == first.pid else ProcessIdentity(second.pid, old.start_ticks)
        events = Events()
        guard = MemoryGuard(mode=MemoryQuotaMode.KILL, procfs=procfs, clock=SystemClock(), events=events)
        actions = guard.check(
            [MemoryView("ns/p/c", GROWER_POD, QUOTA_MIB, [ProcessUse(measured, 2000 * MIB, None, None)])]
        )
        assert [a.action for a in actions] == ["skipped: pid reused"]
        time.sleep(0.1)
        assert second.poll() is None, "a process that was not the measured one was killed"
        assert procfs.is_alive(live)
        assert events.pods == []
        # The same pid with its real start time is killed: the check is what spared it.
        guard.check([MemoryView("ns/p/c", GROWER_POD, QUOTA_MIB, [ProcessUse(live, 2000 * MIB, None, None)])])
        assert second.wait(timeout=5) == -signal.SIGKILL
    finally:
        if second.poll() is None:
            second.kill()
        second.wait()


def test_the_agent_stops_processes_growing_64_mib_every_20_ms_close_to_their_quota(short_dir: Path) -> None:
    """Three growers, started one after another (so at different phases against the checks):
    the old 0.2 s loop gets one within 25 % about 40 % of the time, all three rarely."""
    real_layout()  # skips, with the reason, where there are no cgroups to make
    agent_args = ("--device-guard", "off", "--no-ioctl-tracing")
    with enforced_node(short_dir, agent_args=agent_args) as node:
        # Growth starts 2.5 s in: past the short period a container gets when it first shows up.
        grow = (
            "--grow-to-mib",
            "4096",
            "--grow-after",
            "2.5",
            "--grow-step-mib",
            "64",
            "--grow-every",
            "0.02",
        )
        boxes = [
            node.run_pod(
                f"grower-{i}",
                20,
                memory_mib=QUOTA_MIB,
                busy=0.05,
                workload_mib=64,
                extra=("--kernels", "1", "--kernel-ms", "1", *grow),
            )
            for i in range(3)
        ]
        assert [box.proc.wait(timeout=15) for box in boxes] == [-signal.SIGKILL] * 3

        def peaks() -> list[int] | None:
            gone = {d["pid"]: d["peak_memory_bytes"] for g in node.truth()["gpus"] for d in g["departed"]}
            found = [gone.get(box.pid) for box in boxes]
            return None if None in found else [p // MIB for p in found if p is not None]

        peak_mib = wait_for(peaks, 5, "the growers' contexts gone")
        assert all(QUOTA_MIB < p <= QUOTA_MIB * 1.25 for p in peak_mib), f"killed at {peak_mib} MiB"
        events = wait_for(
            lambda: [e for e in node.api.events() if e.get("reason") == EVENT_REASON and "grower" in str(e)],
            5,
            "the Events",
        )
        assert {e["involvedObject"]["name"] for e in events} <= {f"grower-{i}" for i in range(3)}
