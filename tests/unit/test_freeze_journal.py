"""The freeze journal: its document, atomic writes, writes only on change, corrupt files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from agent.platform.freezejournal import (
    FreezeJournal,
    JournalEntries,
    JournalError,
    JournalProcess,
    ThawReport,
    file_lock,
    thaw_everything,
)
from agent.platform.procfs import ProcessIdentity

A, B = Path("/sys/fs/cgroup/freezer/kubepods/a"), Path("/sys/fs/cgroup/unified/b.scope")
P1, P2, P3 = ProcessIdentity(100, 5000), ProcessIdentity(101, 5001), ProcessIdentity(102, 5002)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "frozen.json"


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every os.replace the journal makes (one per file write)."""
    done: list[str] = []
    real = os.replace

    def counting(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        done.append(str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    return done


def test_round_trip_and_document(path: Path) -> None:
    journal = FreezeJournal(path)
    journal.add_cgroup(B)
    journal.add_cgroup(A)
    journal.add_processes("ns/p/c", [P2, P1])
    journal.add_processes("ns/q/c", [P3])
    document = json.loads(path.read_text())
    assert document == {
        "version": 1,
        "agentPid": os.getpid(),
        "cgroups": [str(A), str(B)],
        "processes": [
            {"pid": 100, "startTicks": 5000, "key": "ns/p/c"},
            {"pid": 101, "startTicks": 5001, "key": "ns/p/c"},
            {"pid": 102, "startTicks": 5002, "key": "ns/q/c"},
        ],
    }
    expected = JournalEntries(
        (A, B),
        (
            JournalProcess(100, 5000, "ns/p/c"),
            JournalProcess(101, 5001, "ns/p/c"),
            JournalProcess(102, 5002, "ns/q/c"),
        ),
    )
    assert journal.entries() == expected
    assert FreezeJournal(path).entries() == expected, "a new journal loads what an earlier one wrote"
    assert (path.parent.stat().st_mode & 0o777) == 0o755

    journal.remove_cgroup(A)
    journal.remove_processes("ns/p/c")
    assert FreezeJournal(path).entries() == JournalEntries((B,), (JournalProcess(102, 5002, "ns/q/c"),))
    journal.clear()
    assert FreezeJournal(path).entries().empty
    assert json.loads(path.read_text())["cgroups"] == []


def test_add_is_a_union_and_replace_is_not(path: Path) -> None:
    journal = FreezeJournal(path)
    journal.add_processes("k", [P1])
    journal.add_processes("k", [P2])
    assert {p.identity for p in journal.entries().processes} == {P1, P2}
    journal.replace_processes("k", [P3])
    assert {p.identity for p in FreezeJournal(path).entries().processes} == {P3}
    journal.replace_processes("k", [])
    assert journal.entries().empty


def test_writes_only_when_the_content_changes(path: Path, writes: list[str]) -> None:
    journal = FreezeJournal(path)
    journal.clear()
    journal.remove_cgroup(A)
    journal.remove_processes("k")
    assert writes == [] and not path.exists(), "nothing to record: no file at all"
    for _ in range(3):
        journal.add_cgroup(A)
        journal.add_processes("k", [P1, P2])
        journal.add_processes("k", [P1])
        journal.replace_processes("k", [P2, P1])
    assert len(writes) == 2
    journal.remove_cgroup(A)
    journal.remove_cgroup(A)
    assert len(writes) == 3
    reloaded = FreezeJournal(path)
    reloaded.add_processes("k", [P1])
    assert len(writes) == 3, "a journal loaded from the file knows what it holds"


def test_a_failed_write_changes_nothing(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = FreezeJournal(path)
    journal.add_cgroup(A)
    before = path.read_bytes()

    def failing(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(JournalError, match="No space left"):
        journal.add_cgroup(B)
    assert journal.entries().cgroups == (A,), "not recorded, so the caller must not freeze it"
    assert path.read_bytes() == before, "the old file is intact"
    assert sorted(p.name for p in path.parent.iterdir()) == ["frozen.json", "frozen.json.lock"], (
        "no temp file"
    )
    monkeypatch.undo()
    journal.add_cgroup(B)
    assert FreezeJournal(path).entries().cgroups == (A, B)


def test_relative_cgroup_paths_are_refused(path: Path) -> None:
    with pytest.raises(JournalError, match="absolute"):
        FreezeJournal(path).add_cgroup(Path("kubepods/x"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"version": 1, "cgroups": [', "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"version": 2, "cgroups": ["/a"]}', "unknown version 2"),
        ('{"version": 1, "cgroups": "/a"}', "'cgroups' and 'processes' must be lists"),
        ("", "not JSON"),
    ],
)
def test_a_corrupt_journal_is_empty_with_a_warning(
    path: Path, text: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    path.parent.mkdir()
    path.write_text(text)
    with caplog.at_level("WARNING"):
        journal = FreezeJournal(path)
    assert journal.entries().empty
    assert any(f"is corrupt, treated as empty: {reason}" in r.getMessage() for r in caplog.records)
    journal.clear()
    assert json.loads(path.read_text())["version"] == 1, "the next write replaces the corrupt file"


def test_an_unreadable_journal_is_empty_with_a_warning(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path.mkdir(parents=True)  # a directory where the file should be
    with caplog.at_level("WARNING"):
        assert FreezeJournal(path).entries().empty
    assert any("is unreadable, treated as empty" in r.getMessage() for r in caplog.records)


def test_bad_entries_are_skipped_the_rest_kept(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path.parent.mkdir()
    document = {
        "version": 1,
        "agentPid": 1,
        "cgroups": ["/ok", "relative", 7],
        "processes": [
            {"pid": 100, "startTicks": 5000, "key": "k"},
            {"pid": 1, "startTicks": 5, "key": "init"},
            {"pid": "101", "startTicks": 5001},
            {"pid": 102},
            "junk",
        ],
    }
    path.write_text(json.dumps(document))
    with caplog.at_level("WARNING"):
        entries = FreezeJournal(path).entries()
    assert entries == JournalEntries((Path("/ok"),), (JournalProcess(100, 5000, "k"),))
    assert len([r for r in caplog.records if "skipping" in r.getMessage()]) == 6


def test_concurrent_changes_are_all_recorded(path: Path) -> None:
    journal = FreezeJournal(path)

    def work(n: int) -> None:
        for i in range(40):
            journal.add_cgroup(Path(f"/cg/{n}/{i}"))
            journal.add_processes(f"k{n}", [ProcessIdentity(1000 + i, n)])

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    entries = FreezeJournal(path).entries()
    assert len(entries.cgroups) == 240
    assert len(entries.processes) == 240
    assert sorted(p.name for p in path.parent.iterdir()) == ["frozen.json", "frozen.json.lock"]


def test_thaw_everything_waits_for_a_writer_holding_the_lock(path: Path) -> None:
    FreezeJournal(path).add_cgroup(Path("/nonexistent/vcuda-test"))
    done = threading.Event()
    reports: list[ThawReport] = []

    def thaw() -> None:
        reports.append(thaw_everything(path))
        done.set()

    with file_lock(path):
        thread = threading.Thread(target=thaw)
        thread.start()
        assert not done.wait(0.2), "thaw_everything rewrote the journal while another writer held it"
    thread.join(5)
    assert reports[0].cgroups_gone == 1
    assert FreezeJournal(path).entries().empty


def test_thaw_everything_without_a_state_dir_creates_nothing(tmp_path: Path) -> None:
    report = thaw_everything(tmp_path / "none" / "frozen.json")
    assert report == ThawReport()
    assert not (tmp_path / "none").exists()
