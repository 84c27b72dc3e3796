"""The watchdog thaws what a dead agent left frozen; start-up thaw of a journal left behind.

The "agent" here is a real child process that builds a journal and a FreezerActuator,
spawns the watchdog, freezes a real test cgroup holding a busy process and waits; the
test SIGKILLs it and measures how long the cgroup stays frozen.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.control.actuators import FreezerActuator, ThrottleTarget
from agent.errors import ProcessGoneError
from agent.platform import watchdog as watchdog_module
from agent.platform.cgroups.freezer import is_frozen, set_frozen
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.freezejournal import FreezeJournal, thaw_everything
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.platform.watchdog import spawn_watchdog
from tests.integration.cgroup_trees import CgroupTree
from tests.integration.freezing import (
    AGENT_SCRIPT,
    advances,
    busy_child,
    stalled,
    state,
    thawing_tree,
    ticks,
    wait_for,
)

pytestmark = pytest.mark.privileged

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with thawing_tree() as made:
        yield made


def gone(pid: int) -> bool:
    try:
        return ProcFS().stat(pid).state in ("Z", "X")
    except ProcessGoneError:
        return True


def kill_agent_and_time_the_thaw(tree: CgroupTree, tmp_path: Path, hierarchy: str, *extra: str) -> None:
    cgroup = tree.mkdir(hierarchy, "pod/ctr")
    child = busy_child(tree, cgroup)
    journal_path = tmp_path / "state" / "frozen.json"
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-c", AGENT_SCRIPT, str(journal_path), str(cgroup), *extra],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=REPO,
        )
    forked = 0
    try:
        assert agent.stdout is not None
        line = agent.stdout.readline().split()
        assert len(line) == 2, f"the agent did not start: {log_path.read_text()}"
        watchdog_pid, forked = int(line[0]), int(line[1])
        assert is_frozen(cgroup)
        assert stalled(child.pid, 0.2)

        agent.kill()
        killed_at = time.monotonic()
        assert wait_for(lambda: not is_frozen(cgroup), timeout_s=2.0, step_s=0.002)
        start = ticks(child.pid)
        assert wait_for(lambda: ticks(child.pid) > start, timeout_s=2.0, step_s=0.002)
        elapsed = time.monotonic() - killed_at
        assert elapsed < 1.0, f"thawed and running again only {elapsed:.3f} s after the kill"
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        assert agent.stdout is not None
        agent.stdout.close()
        if forked:
            os.kill(forked, signal.SIGKILL)
    assert wait_for(lambda: gone(watchdog_pid)), "the watchdog did not exit after thawing"
    assert json.loads(journal_path.read_text())["cgroups"] == []
    assert wait_for(lambda: "thawed 1 cgroup(s)" in log_path.read_text())
    assert "INFO agent.platform.watchdog: agent (pid" in log_path.read_text()


@pytest.mark.parametrize("hierarchy", [UNIFIED, "freezer"])
def test_agent_killed_cgroup_thawed_within_a_second(tree: CgroupTree, tmp_path: Path, hierarchy: str) -> None:
    kill_agent_and_time_the_thaw(tree, tmp_path, hierarchy)


def test_a_forked_child_of_the_agent_does_not_hold_the_pipe(tree: CgroupTree, tmp_path: Path) -> None:
    kill_agent_and_time_the_thaw(tree, tmp_path, UNIFIED, "fork")


def test_a_dropped_handle_keeps_the_watchdog_waiting(tmp_path: Path) -> None:
    handle = spawn_watchdog(tmp_path / "frozen.json")
    pid = handle.pid
    del handle
    gc.collect()
    time.sleep(0.2)
    assert not gone(pid), "garbage-collecting the handle closed the pipe"
    (kept,) = [h for h in watchdog_module._live if h.pid == pid]
    assert kept.close() == 0


def test_clean_close_after_release_all(tree: CgroupTree, tmp_path: Path) -> None:
    cgroup = tree.mkdir(UNIFIED, "pod/ctr")
    child = busy_child(tree, cgroup)
    journal = FreezeJournal(tmp_path / "frozen.json")
    watchdog = spawn_watchdog(journal.path)
    actuator = FreezerActuator(journal)
    actuator.freeze(ThrottleTarget("ns/pod/ctr", cgroup, None))
    assert is_frozen(cgroup)
    actuator.release_all()
    assert watchdog.alive()
    assert watchdog.close() == 0
    assert not watchdog.alive()
    assert not is_frozen(cgroup)
    assert advances(child.pid, 1.0)
    assert FreezeJournal(journal.path).entries().empty


def test_closing_the_pipe_thaws_what_is_still_frozen(tree: CgroupTree, tmp_path: Path) -> None:
    cgroup = tree.mkdir("freezer", "pod/ctr")
    child = busy_child(tree, cgroup)
    journal = FreezeJournal(tmp_path / "frozen.json")
    watchdog = spawn_watchdog(journal.path)
    FreezerActuator(journal).freeze(ThrottleTarget("ns/pod/ctr", cgroup, None))
    assert is_frozen(cgroup)
    assert watchdog.close() == 0
    assert not is_frozen(cgroup)
    assert advances(child.pid, 1.0)


def test_watchdog_ignores_terminal_and_agent_signals(tmp_path: Path) -> None:
    watchdog = spawn_watchdog(tmp_path / "frozen.json")
    try:
        assert os.getsid(watchdog.pid) == watchdog.pid, "its own session: Ctrl-C never reaches it"
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(watchdog.pid, signum)
        time.sleep(0.3)
        assert watchdog.alive()
    finally:
        code = watchdog.close()
    assert code == 0


def test_watchdog_starts_fast_and_light(tmp_path: Path) -> None:
    probe = "import sys, agent.platform.watchdog; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.split()
    ours = {m for m in loaded if m.startswith("agent")}
    assert ours <= {
        "agent",
        "agent.errors",
        "agent.platform",
        "agent.platform.atomicfile",
        "agent.platform.cgroups",
        "agent.platform.cgroups.freezer",
        "agent.platform.freezejournal",
        "agent.platform.procfs",
        "agent.platform.procsignal",
        "agent.platform.watchdog",
    }
    heavy = {"grpc", "kubernetes", "prometheus_client", "bcc", "pyroute2", "google.protobuf", "yaml"}
    assert not heavy & set(loaded)
    started = time.monotonic()
    watchdog = spawn_watchdog(tmp_path / "frozen.json")
    ready_s = time.monotonic() - started
    assert watchdog.close() == 0
    assert ready_s < 1.0, f"the watchdog took {ready_s:.2f} s to be ready"


def test_start_up_thaw_of_a_journal_left_by_a_dead_run(tree: CgroupTree, tmp_path: Path) -> None:
    frozen = tree.mkdir(UNIFIED, "pod/a")
    child = busy_child(tree, frozen)
    removed = tree.mkdir("freezer", "pod/b")
    stopped = tree.sleeper()
    reused = tree.sleeper()
    procfs = ProcFS()
    set_frozen(frozen, True)  # what the dead run left frozen, by hand
    os.kill(stopped.pid, signal.SIGSTOP)
    os.kill(reused.pid, signal.SIGSTOP)  # stopped by someone else: its journal entry is stale
    removed.rmdir()
    path = tmp_path / "frozen.json"
    journal = FreezeJournal(path)
    journal.add_cgroup(frozen)
    journal.add_cgroup(removed)
    journal.add_processes("ns/pod/c", [procfs.identity(stopped.pid)])
    stale = ProcessIdentity(reused.pid, procfs.identity(reused.pid).start_ticks + 1)
    journal.add_processes("ns/pod/d", [stale])
    journal.add_processes("ns/pod/e", [ProcessIdentity(2**22 - 1, 1)])  # no such process

    report = thaw_everything(path)
    assert (report.cgroups_thawed, report.cgroups_gone) == (1, 1)
    assert (report.processes_continued, report.processes_reused, report.processes_gone) == (1, 1, 1)
    assert report.failures == 0
    assert report.found == 5
    assert not is_frozen(frozen)
    assert advances(child.pid, 1.0)
    assert wait_for(lambda: state(stopped.pid) != "T")
    assert state(reused.pid) == "T", "a pid whose start time differs was signalled"
    assert FreezeJournal(path).entries().empty
    assert json.loads(path.read_text())["processes"] == []


def test_start_up_thaw_of_a_corrupt_journal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "frozen.json"
    path.write_text('{"version": 1, "cgroups": [')
    with caplog.at_level("WARNING", logger="agent.platform.freezejournal"):
        report = thaw_everything(path)
    assert report.summary().startswith("thawed 0 cgroup(s)")
    assert report.found == 0
    assert any("is corrupt, treated as empty: not JSON" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["cgroups"] == [], "the corrupt file is replaced by an empty journal"
