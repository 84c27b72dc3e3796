"""The freezer and the actuators on this machine's real cgroups (v2 and v1) with real processes.

What is observed is what the kernel says: a paused process gets no CPU time (utime +
stime in /proc/<pid>/stat stop advancing); a SIGSTOPped one is in state T.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.control.actuators import (
    AutoActuator,
    FreezerActuator,
    SignalActuator,
    ThrottleTarget,
    make_actuator,
)
from agent.platform.cgroups.freezer import (
    CgroupGoneError,
    FreezerError,
    freezer_file,
    is_frozen,
    set_frozen,
)
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.freezejournal import FreezeJournal
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.platform.procsignal import SignalOutcome, signal_identity
from agent.settings import ActuatorMode
from tests.integration.cgroup_trees import CgroupTree
from tests.integration.freezing import advances, busy_child, stalled, state, thawing_tree, wait_for

pytestmark = pytest.mark.privileged

HIERARCHIES = {"v2": UNIFIED, "v1": "freezer"}


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with thawing_tree() as made:
        yield made


@pytest.fixture
def journal(tmp_path: Path) -> FreezeJournal:
    return FreezeJournal(tmp_path / "state" / "frozen.json")


def fully_frozen(cgroup_dir: Path) -> bool:
    """The kernel finished freezing (v2 cgroup.events ``frozen 1``, v1 FROZEN, not FREEZING)."""
    events = cgroup_dir / "cgroup.events"
    if events.exists():
        return "frozen 1" in events.read_text().splitlines()
    return (cgroup_dir / "freezer.state").read_text().strip() == "FROZEN"


def journal_doc(journal: FreezeJournal) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(journal.path.read_text())
    return loaded


@pytest.mark.parametrize("version", sorted(HIERARCHIES))
def test_freeze_stops_cpu_time_and_thaw_resumes_it(tree: CgroupTree, version: str) -> None:
    cgroup = tree.mkdir(HIERARCHIES[version], "pod/ctr")
    assert freezer_file(cgroup) == cgroup / ("cgroup.freeze" if version == "v2" else "freezer.state")
    child = busy_child(tree, cgroup)
    assert advances(child.pid), "the busy child never ran"
    assert not is_frozen(cgroup)

    set_frozen(cgroup, True)
    assert is_frozen(cgroup)
    assert wait_for(lambda: fully_frozen(cgroup)), "the kernel did not finish freezing"
    assert stalled(child.pid, 0.3), "a frozen process still got CPU time"

    set_frozen(cgroup, False)
    assert not is_frozen(cgroup)
    assert advances(child.pid, 1.0), "the thawed process did not run again"


@pytest.mark.parametrize("version", sorted(HIERARCHIES))
def test_a_removed_cgroup_is_gone(tree: CgroupTree, version: str) -> None:
    cgroup = tree.mkdir(HIERARCHIES[version], "pod/ctr")
    cgroup.rmdir()
    with pytest.raises(CgroupGoneError, match="is gone"):
        set_frozen(cgroup, True)
    with pytest.raises(CgroupGoneError):
        is_frozen(cgroup)
    assert freezer_file(cgroup) is None


def test_a_dir_without_freezer_is_an_error_but_not_gone(tmp_path: Path) -> None:
    with pytest.raises(FreezerError, match=r"neither cgroup\.freeze nor freezer\.state") as caught:
        set_frozen(tmp_path, True)
    assert not isinstance(caught.value, CgroupGoneError)


@pytest.mark.parametrize("version", sorted(HIERARCHIES))
def test_freezer_actuator_journals_before_freezing(
    tree: CgroupTree, journal: FreezeJournal, version: str
) -> None:
    cgroup = tree.mkdir(HIERARCHIES[version], "pod/ctr")
    child = busy_child(tree, cgroup)
    actuator = FreezerActuator(journal)
    target = ThrottleTarget("ns/pod/ctr", cgroup, None)

    actuator.freeze(target)
    assert journal_doc(journal)["cgroups"] == [str(cgroup)]
    assert is_frozen(cgroup)
    assert wait_for(lambda: fully_frozen(cgroup))
    assert stalled(child.pid)
    actuator.thaw(target)
    assert not is_frozen(cgroup)
    assert journal.entries().cgroups == (cgroup,), "thaw alone keeps the journal entry"
    assert advances(child.pid, 1.0)

    actuator.freeze(target)
    actuator.release(target)
    assert not is_frozen(cgroup)
    assert journal_doc(journal)["cgroups"] == []


def test_freezer_actuator_takes_gone_cgroups_in_its_stride(tree: CgroupTree, journal: FreezeJournal) -> None:
    gone_on_thaw = tree.mkdir(UNIFIED, "pod/a")
    actuator = FreezerActuator(journal)
    target = ThrottleTarget("ns/pod/a", gone_on_thaw, None)
    actuator.freeze(target)
    set_frozen(gone_on_thaw, False)
    gone_on_thaw.rmdir()
    actuator.thaw(target)  # not an error
    assert journal.entries().cgroups == ()
    actuator.release(target)  # neither is this
    with pytest.raises(CgroupGoneError):
        actuator.freeze(target)
    assert journal.entries().cgroups == (), "a cgroup that could not be frozen is not kept"
    with pytest.raises(FreezerError, match="no cgroup directory"):
        actuator.freeze(ThrottleTarget("ns/pod/b", None, None))


def test_release_all_thaws_every_cgroup_and_writes_the_journal_once(
    tree: CgroupTree, journal: FreezeJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = [tree.mkdir(UNIFIED, "pod/a"), tree.mkdir("freezer", "pod/b"), tree.mkdir(UNIFIED, "pod/c")]
    actuator = FreezerActuator(journal)
    for n, cgroup in enumerate(dirs):
        actuator.freeze(ThrottleTarget(f"ns/pod/{n}", cgroup, None))
    assert all(is_frozen(d) for d in dirs)
    writes: list[str] = []
    real = os.replace

    def counting(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        writes.append(str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    actuator.release_all()
    assert not any(is_frozen(d) for d in dirs)
    assert journal.entries().empty
    assert writes == [str(journal.path)]  # one write for all of them, after the thaws


@pytest.mark.parametrize("version", sorted(HIERARCHIES))
def test_a_cgroup_paused_by_someone_else_is_left_alone(
    tree: CgroupTree, journal: FreezeJournal, version: str
) -> None:
    cgroup = tree.mkdir(HIERARCHIES[version], "pod/ctr")
    target = ThrottleTarget("ns/pod/ctr", cgroup, None)
    actuator = FreezerActuator(journal)
    actuator.freeze(target)
    actuator.thaw(target)
    set_frozen(cgroup, True)  # the runtime pauses it (ctr task pause writes the same file)
    actuator.freeze(target)
    actuator.thaw(target)
    actuator.release_all()
    assert is_frozen(cgroup) and journal.entries().empty  # not thawed, and no watchdog will
    set_frozen(cgroup, False)  # resumed by the runtime: throttled again
    actuator.freeze(target)
    assert is_frozen(cgroup) and journal.entries().cgroups == (cgroup,)
    actuator.release(target)
    assert not is_frozen(cgroup)


def test_a_predecessors_leftover_freeze_is_the_agents_to_undo(tree: CgroupTree, tmp_path: Path) -> None:
    """Frozen by an agent whose start-up thaw then failed: still in the journal, so not taken
    for a runtime's pause; the next slice's thaw undoes it."""
    cgroup = tree.mkdir(UNIFIED, "pod/ctr")
    FreezeJournal(tmp_path / "frozen.json").add_cgroup(cgroup)
    set_frozen(cgroup, True)
    target = ThrottleTarget("ns/pod/ctr", cgroup, None)
    actuator = FreezerActuator(FreezeJournal(tmp_path / "frozen.json"))
    actuator.freeze(target)
    actuator.thaw(target)
    assert not is_frozen(cgroup)


def test_signal_actuator_stops_and_continues(tree: CgroupTree, journal: FreezeJournal) -> None:
    cgroup = tree.mkdir(UNIFIED, "pod/ctr")
    child = busy_child(tree, cgroup)
    actuator = SignalActuator(journal)
    target = ThrottleTarget("ns/pod/ctr", None, cgroup / "cgroup.procs")
    identity = ProcFS().identity(child.pid)

    actuator.freeze(target)
    assert wait_for(lambda: state(child.pid) == "T")
    assert stalled(child.pid)
    assert actuator.stopped("ns/pod/ctr") == {identity}
    assert journal_doc(journal)["processes"] == [
        {"pid": child.pid, "startTicks": identity.start_ticks, "key": "ns/pod/ctr"}
    ]
    actuator.thaw(target)
    assert wait_for(lambda: state(child.pid) != "T")
    assert advances(child.pid, 1.0)
    assert actuator.stopped("ns/pod/ctr") == frozenset()

    # A process that joins while the container is paused is stopped at the next freeze.
    actuator.freeze(target)
    late = busy_child(tree, cgroup)
    assert advances(late.pid), "the late process runs until the next freeze"
    actuator.thaw(target)
    actuator.freeze(target)
    assert wait_for(lambda: state(late.pid) == "T" and state(child.pid) == "T")
    actuator.release(target)
    assert wait_for(lambda: state(late.pid) != "T" and state(child.pid) != "T")
    assert journal.entries().empty


class StaleProcFS(ProcFS):
    """Hands out identities whose start time is wrong: as if the pid had been reused since."""

    def identity(self, pid: int) -> ProcessIdentity:
        real = super().identity(pid)
        return ProcessIdentity(pid, real.start_ticks + 1)


def test_a_reused_pid_is_never_signalled(tree: CgroupTree, journal: FreezeJournal, tmp_path: Path) -> None:
    sleeper = tree.sleeper()
    wrong = ProcessIdentity(sleeper.pid, ProcFS().identity(sleeper.pid).start_ticks + 1)
    assert signal_identity(wrong, signal.SIGSTOP) is SignalOutcome.REUSED

    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{sleeper.pid}\n")
    actuator = SignalActuator(journal, StaleProcFS())
    actuator.freeze(ThrottleTarget("ns/pod/ctr", None, procs))
    assert actuator.stopped("ns/pod/ctr") == frozenset()
    assert not wait_for(lambda: state(sleeper.pid) == "T", timeout_s=0.3), "a reused pid was stopped"
    assert state(sleeper.pid) == "S"


def test_never_signals_init_or_itself(journal: FreezeJournal, tmp_path: Path) -> None:
    assert signal_identity(ProcFS().identity(os.getpid()), signal.SIGSTOP) is SignalOutcome.REFUSED
    assert signal_identity(ProcFS().identity(1), signal.SIGSTOP) is SignalOutcome.REFUSED
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"1\n{os.getpid()}\n")
    actuator = SignalActuator(journal)
    actuator.freeze(ThrottleTarget("ns/pod/ctr", None, procs))
    assert actuator.stopped("ns/pod/ctr") == frozenset()
    assert state(os.getpid()) != "T"


def test_auto_uses_signals_without_a_writable_freezer(
    tree: CgroupTree, journal: FreezeJournal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sleeper = tree.sleeper()
    fake = tmp_path / "ctr"  # a cgroup dir with a procs file and no freezer file
    fake.mkdir()
    (fake / "cgroup.procs").write_text(f"{sleeper.pid}\n")
    target = ThrottleTarget("ns/pod/fake", fake, fake / "cgroup.procs")
    actuator = AutoActuator(journal)
    with caplog.at_level("INFO", logger="agent.control.actuators"):
        actuator.freeze(target)
        actuator.thaw(target)
        actuator.freeze(target)
    assert actuator.mechanism(target) == "signals"
    assert [r.getMessage() for r in caplog.records] == [
        f"ns/pod/fake: paused with signals ({fake} has no cgroup.freeze or freezer.state)"
    ]
    assert wait_for(lambda: state(sleeper.pid) == "T")
    actuator.release(target)
    assert wait_for(lambda: state(sleeper.pid) != "T")
    assert actuator.mechanism(target) is None


def test_auto_uses_the_freezer_on_a_real_cgroup(tree: CgroupTree, journal: FreezeJournal) -> None:
    cgroup = tree.mkdir(UNIFIED, "pod/ctr")
    child = busy_child(tree, cgroup)
    target = ThrottleTarget("ns/pod/ctr", cgroup, cgroup / "cgroup.procs")
    actuator = make_actuator(ActuatorMode.AUTO, journal)
    assert isinstance(actuator, AutoActuator)
    actuator.freeze(target)
    assert actuator.mechanism(target) == "freezer"
    assert is_frozen(cgroup)
    assert state(child.pid) != "T", "the freezer, not SIGSTOP"
    actuator.release_all()
    assert not is_frozen(cgroup)
    assert journal.entries().empty


def test_auto_uses_signals_when_the_freezer_file_is_read_only(
    tree: CgroupTree, journal: FreezeJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    cgroup = tree.mkdir(UNIFIED, "pod/ctr")
    child = busy_child(tree, cgroup)
    target = ThrottleTarget("ns/pod/ctr", cgroup, cgroup / "cgroup.procs")
    real_access = os.access
    # As on a read-only /sys/fs/cgroup (EROFS): root passes every other access check.
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p).endswith("cgroup.freeze") else real_access(p, mode)
    )
    actuator = AutoActuator(journal)
    actuator.freeze(target)
    assert actuator.mechanism(target) == "signals"
    assert not is_frozen(cgroup)
    assert wait_for(lambda: state(child.pid) == "T")
    actuator.release_all()
    assert wait_for(lambda: state(child.pid) != "T")


def test_auto_decides_later_for_a_cgroup_not_there_yet(tree: CgroupTree, journal: FreezeJournal) -> None:
    missing = tree.root(UNIFIED) / "not-yet"
    target = ThrottleTarget("ns/pod/ctr", missing, missing / "cgroup.procs")
    actuator = AutoActuator(journal)
    actuator.thaw(target)  # never frozen: nothing to do, whatever the state of its cgroup
    actuator.release(target)
    with pytest.raises(CgroupGoneError):
        actuator.freeze(target)
    assert actuator.mechanism(target) is None
    made = tree.mkdir(UNIFIED, "not-yet")
    actuator.freeze(target)
    assert actuator.mechanism(target) == "freezer"
    assert is_frozen(made)
    actuator.release(target)
    assert not is_frozen(made)


def test_make_actuator_modes(journal: FreezeJournal) -> None:
    assert make_actuator(ActuatorMode.FREEZER, journal).name == "freezer"
    assert make_actuator(ActuatorMode.SIGNALS, journal).name == "signals"
    assert make_actuator(ActuatorMode.AUTO, journal).name == "auto"
