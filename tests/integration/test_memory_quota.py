"""The memory guard in kill mode against real processes on a simulated GPU node.

Two real workloads share simulated GPU 0: a neighbour at 512 MiB and a grower that
declares 800 MiB, then 1500 MiB after 1 s, with a 1024 MiB quota. The guard, checked every
0.2 s as the agent runs it, must SIGKILL the grower (through a pidfd, after the pid + start
time check) within 1 s of the growth, record the Event, and leave the neighbour alone.
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
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.kube.pods import PodInfo
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.settings import MemoryQuotaMode

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
