"""The memory guard over a fake /proc tree, with a recording Event sink and kill function."""

from __future__ import annotations

import logging
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.clock import VirtualClock
from agent.control.memguard import EVENT_REASON, MemoryGuard, MemoryView, process_uses
from agent.domain.memquota import MIB, ProcessUse
from agent.errors import PlatformError
from agent.platform.gpu.inventory import ProcessMemory
from agent.platform.kube.pods import PodInfo
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.settings import MemoryQuotaMode

OWN_PID = 4000
POD = PodInfo(uid="u-1", namespace="ns", name="trainer")


class FakeProc:
    """A /proc with one stat file per process (the format of tests/unit/test_procevents_cache.py)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def start(self, pid: int, start_ticks: int, state: str = "S") -> ProcessIdentity:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(
            f"{pid} (proc) {state} 1 {pid} {pid} 0 -1 0 0 0 0 0 1 2 0 0 20 0 1 0 {start_ticks} 0 0\n"
        )
        return ProcessIdentity(pid, start_ticks)

    def exit(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


@dataclass
class Events:
    pods: list[tuple[PodInfo, str, str]] = field(default_factory=list)

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        self.pods.append((pod, reason, message))

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        raise AssertionError("the memory guard emits pod Events only")


@dataclass
class FakeDeny:
    quotas: dict[int, tuple[int, int]] = field(default_factory=dict)
    removed: list[int] = field(default_factory=list)
    fail: bool = False

    def set_quota(self, cgroup_id: int, quota_bytes: int, used_bytes: int) -> None:
        if self.fail:
            raise PlatformError("map update refused")
        self.quotas[cgroup_id] = (quota_bytes, used_bytes)

    def remove_quota(self, cgroup_id: int) -> None:
        self.quotas.pop(cgroup_id, None)
        self.removed.append(cgroup_id)


@dataclass
class Rig:
    proc: FakeProc
    events: Events
    kills: list[tuple[int, int]]
    clock: VirtualClock

    def guard(self, mode: MemoryQuotaMode = MemoryQuotaMode.KILL, **kwargs: object) -> MemoryGuard:
        return MemoryGuard(
            mode=mode,
            procfs=ProcFS(self.proc.root),
            clock=self.clock,
            events=self.events,
            own_pid=OWN_PID,
            kill=lambda pid, sig: self.kills.append((pid, sig)),
            **kwargs,  # type: ignore[arg-type]
        )


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(FakeProc(tmp_path), Events(), [], VirtualClock())


def view(
    *uses: ProcessUse,
    quota_mib: int | None = 1024,
    key: str = "ns/trainer/main",
    cgroup_id: int | None = None,
) -> MemoryView:
    return MemoryView(key, POD, quota_mib, uses, cgroup_id)


def use(ident: ProcessIdentity, mib: int, last_alloc_ns: int | None = None) -> ProcessUse:
    traced = None if last_alloc_ns is None else mib * MIB
    return ProcessUse(ident, mib * MIB, traced, last_alloc_ns)


def test_kill_mode_kills_the_culprit_exactly_once_with_one_event(rig: Rig) -> None:
    small, big = rig.proc.start(100, 5000), rig.proc.start(101, 5001)
    guard = rig.guard()
    over = view(use(small, 300), use(big, 900))
    actions = guard.check([over])
    assert rig.kills == [(101, signal.SIGKILL)]
    assert [a.action for a in actions] == ["killed pid 101"]
    assert len(rig.events.pods) == 1
    pod, reason, message = rig.events.pods[0]
    assert pod is POD and reason == EVENT_REASON == "GPUMemoryQuotaExceeded"
    assert "1200 MiB" in message and "1024 MiB" in message and "pid 101" in message
    # The process takes a moment to die: later checks see it still listed and do nothing.
    for _ in range(3):
        rig.clock.advance(0.2)
        assert guard.check([over]) == []
    assert rig.kills == [(101, signal.SIGKILL)]
    assert len(rig.events.pods) == 1
    assert guard.stats() == {"kills": 1, "audits": 0, "skipped": 0}
    record = guard.recent_actions[-1]
    assert (record.key, record.action, record.used_bytes, record.quota_bytes, record.pid) == (
        "ns/trainer/main",
        "killed pid 101",
        1200 * MIB,
        1024 * MIB,
        101,
    )


def test_culprit_is_the_latest_allocation_when_traced(rig: Rig) -> None:
    early, late = rig.proc.start(100, 5000), rig.proc.start(101, 5001)
    rig.guard().check([view(use(early, 900, last_alloc_ns=1), use(late, 200, last_alloc_ns=2))])
    assert rig.kills == [(101, signal.SIGKILL)]


def test_a_reused_pid_is_never_killed(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    measured = rig.proc.start(100, 5000)
    rig.proc.exit(100)
    rig.proc.start(100, 7777)  # the pid now belongs to another process
    guard = rig.guard()
    with caplog.at_level(logging.WARNING):
        actions = guard.check([view(use(measured, 2000))])
        guard.check([view(use(measured, 2000))])  # NVML still lists it: said once
    assert rig.kills == []
    assert rig.events.pods == []
    assert [a.action for a in actions] == ["skipped: pid reused"]
    assert sum("pid 100 was reused/exited; not killed" in r.getMessage() for r in caplog.records) == 1
    assert guard.stats() == {"kills": 0, "audits": 0, "skipped": 1}


def test_an_exited_pid_is_not_killed(rig: Rig) -> None:
    gone = rig.proc.start(100, 5000)
    rig.proc.exit(100)
    zombie = rig.proc.start(101, 5001, state="Z")
    guard = rig.guard()
    guard.check([view(use(gone, 2000))])
    guard.check([view(use(zombie, 2000), key="ns/other/main")])
    assert rig.kills == []
    assert guard.stats()["skipped"] == 2


def test_init_and_the_agent_itself_are_never_killed(rig: Rig) -> None:
    init, agent = rig.proc.start(1, 1), rig.proc.start(OWN_PID, 42)
    guard = rig.guard()
    guard.check([view(use(init, 2000), key="a"), view(use(agent, 2000), key="b")])
    guard.check([view(use(init, 2000), key="a"), view(use(agent, 2000), key="b")])
    assert rig.kills == []
    assert guard.stats() == {"kills": 0, "audits": 0, "skipped": 2}


def test_containers_under_quota_or_without_one_are_untouched(rig: Rig) -> None:
    a, b = rig.proc.start(100, 5000), rig.proc.start(101, 5001)
    guard = rig.guard()
    actions = guard.check([view(use(a, 1024)), view(use(b, 50_000), quota_mib=None, key="whole")])
    assert actions == [] and rig.kills == [] and rig.events.pods == []
    assert list(guard.recent_actions) == []


def test_a_second_process_going_over_later_is_killed_too(rig: Rig) -> None:
    first, second = rig.proc.start(100, 5000), rig.proc.start(101, 5001)
    guard = rig.guard()
    guard.check([view(use(first, 1500), use(second, 100))])
    rig.proc.exit(100)  # it died and left the measurement
    guard.check([view(use(second, 100))])
    guard.check([view(use(second, 1100))])
    assert rig.kills == [(100, signal.SIGKILL), (101, signal.SIGKILL)]
    assert len(rig.events.pods) == 2


def test_audit_reports_once_per_episode(rig: Rig) -> None:
    ident = rig.proc.start(100, 5000)
    guard = rig.guard(MemoryQuotaMode.AUDIT)
    over, under = view(use(ident, 1500)), view(use(ident, 1000))
    for v in (over, over, over, under, under, over, over):
        guard.check([v])
    assert rig.kills == []
    assert [reason for _, reason, _ in rig.events.pods] == [EVENT_REASON, EVENT_REASON]
    assert "audit" in rig.events.pods[0][2]
    assert [a.action for a in guard.recent_actions] == ["audit", "audit"]
    assert guard.stats() == {"kills": 0, "audits": 2, "skipped": 0}


def test_audit_episode_ends_when_the_container_goes_away(rig: Rig) -> None:
    ident = rig.proc.start(100, 5000)
    guard = rig.guard(MemoryQuotaMode.AUDIT)
    guard.check([view(use(ident, 1500))])
    guard.check([])
    guard.check([view(use(ident, 1500))])
    assert len(rig.events.pods) == 2


def test_deny_sets_quotas_and_reports_instead_of_killing(rig: Rig) -> None:
    ident = rig.proc.start(100, 5000)
    deny = FakeDeny()
    guard = rig.guard(MemoryQuotaMode.DENY, deny=deny)
    guard.check([view(use(ident, 800), cgroup_id=77)])
    assert deny.quotas == {77: (1024 * MIB, 800 * MIB)}
    guard.check([view(use(ident, 1500), cgroup_id=77)])
    guard.check([view(use(ident, 1500), cgroup_id=77)])
    assert deny.quotas == {77: (1024 * MIB, 1500 * MIB)}
    assert rig.kills == []
    assert len(rig.events.pods) == 1 and "deny" in rig.events.pods[0][2]
    guard.check([])
    assert deny.quotas == {} and deny.removed == [77]


def test_deny_kills_when_it_cannot_deny(rig: Rig) -> None:
    a, b, c = rig.proc.start(100, 5000), rig.proc.start(101, 5001), rig.proc.start(102, 5002)
    rig.guard(MemoryQuotaMode.DENY).check([view(use(a, 1500), cgroup_id=77)])  # no program
    rig.guard(MemoryQuotaMode.DENY, deny=FakeDeny()).check([view(use(b, 1500))])  # no cgroup id
    rig.guard(MemoryQuotaMode.DENY, deny=FakeDeny(fail=True)).check([view(use(c, 1500), cgroup_id=7)])
    assert rig.kills == [(100, signal.SIGKILL), (101, signal.SIGKILL), (102, signal.SIGKILL)]


def test_recent_actions_are_bounded(rig: Rig) -> None:
    guard = rig.guard(MemoryQuotaMode.AUDIT, history=3)
    views = [view(use(rig.proc.start(100 + i, 5000 + i), 2000), key=f"c{i}") for i in range(5)]
    guard.check(views)
    assert [a.key for a in guard.recent_actions] == ["c2", "c3", "c4"]
    assert guard.stats()["audits"] == 5


def test_process_uses_groups_by_pid_and_drops_exited(rig: Rig) -> None:
    a = rig.proc.start(100, 5000)
    memory = [ProcessMemory(100, 100 * MIB), ProcessMemory(100, 50 * MIB), ProcessMemory(999, MIB)]
    uses = process_uses(memory, ProcFS(rig.proc.root))
    assert uses == [ProcessUse(a, 150 * MIB, None, None)]
    traced = process_uses(memory, ProcFS(rig.proc.root), traced={100: 300 * MIB}, last_alloc_ns={100: 9})
    assert traced == [ProcessUse(a, 150 * MIB, 300 * MIB, 9)]


def test_a_partial_check_keeps_the_state_of_containers_it_did_not_cover(rig: Rig) -> None:
    """Checks near a quota cover only the containers near it: one not given is not gone."""
    a, b = rig.proc.start(100, 5000), rig.proc.start(101, 5001)
    deny = FakeDeny()
    guard = rig.guard(MemoryQuotaMode.DENY, deny=deny)
    guard.check([view(use(a, 1500), cgroup_id=77), view(use(b, 900), key="ns/near/main", cgroup_id=78)])
    assert len(rig.events.pods) == 1
    guard.check([view(use(b, 1000), key="ns/near/main", cgroup_id=78)], partial=True)
    assert deny.removed == [] and set(deny.quotas) == {77, 78}
    guard.check([view(use(a, 1500), cgroup_id=77), view(use(b, 1000), key="ns/near/main", cgroup_id=78)])
    assert len(rig.events.pods) == 1  # the episode of ns/trainer/main goes on: reported once
    guard.check([view(use(b, 1000), key="ns/near/main", cgroup_id=78)])  # a full check: a is gone
    assert deny.removed == [77]
