"""The agent's own files (agent.platform.atomicfile): whole-file writes through a temp file,
fsync, rename and a directory fsync; reads and directories; every OSError a PlatformError
naming the path, raised from it. And the control layer's files that go through it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from agent.control.mpsgrants import MpsGrant, load_grants, save_grants
from agent.errors import PlatformError
from agent.platform.atomicfile import ensure_dir, read_text, remove, write_atomic
from agent.platform.cgroups.freezer import CgroupGoneError, FreezerError, freezer_access
from agent.platform.cgroups.procs import read_pids
from agent.platform.gpu.mpspartition import partition_for


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each os.fsync was given: "file" or "dir"."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_write_replaces_the_file_whole_with_its_mode_and_is_synced(
    tmp_path: Path, synced: list[str]
) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    old_umask = os.umask(0o077)
    try:
        write_atomic(path, b'{"new": 1}', mode=0o644)
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b'{"new": 1}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # whatever the umask
    assert synced == ["file", "dir"]  # the data before the rename, the rename after it
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left


def test_a_write_that_need_not_survive_a_power_loss_is_not_synced(tmp_path: Path, synced: list[str]) -> None:
    write_atomic(tmp_path / "journal.json", b"{}", durable=False)
    assert synced == []
    assert (tmp_path / "journal.json").read_bytes() == b"{}"


def test_a_failed_write_is_a_platform_error_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(PlatformError, match=r"cannot write .*missing/state\.json") as caught:
        write_atomic(tmp_path / "missing" / "state.json", b"x")
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    path = tmp_path / "state.json"
    path.write_text("old")

    def refused(_src: object, _dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PlatformError, match="No space left") as caught:
        write_atomic(path, b"new")
    assert isinstance(caught.value.__cause__, OSError)
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_parents_are_made_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.json"
    write_atomic(path, b"x", make_parents=True)
    assert path.read_bytes() == b"x"
    (tmp_path / "file").write_text("")
    with pytest.raises(PlatformError, match="cannot create the directory") as caught:
        write_atomic(tmp_path / "file" / "sub" / "state.json", b"x", make_parents=True)
    assert isinstance(caught.value.__cause__, OSError)


def test_reads_tell_a_missing_file_from_an_unreadable_one(tmp_path: Path) -> None:
    assert read_text(tmp_path / "none") is None
    (tmp_path / "ok").write_text("text")
    assert read_text(tmp_path / "ok") == "text"
    (tmp_path / "dir").mkdir()
    with pytest.raises(PlatformError, match=r"cannot read .*dir") as caught:
        read_text(tmp_path / "dir")
    assert isinstance(caught.value.__cause__, IsADirectoryError)
    (tmp_path / "latin1").write_bytes(b"\xff\xfe")
    with pytest.raises(PlatformError, match="cannot read"):
        read_text(tmp_path / "latin1")


def test_directories_and_removal(tmp_path: Path) -> None:
    ensure_dir(tmp_path / "x" / "y", mode=0o755)
    assert stat.S_IMODE((tmp_path / "x" / "y").stat().st_mode) == 0o755
    ensure_dir(tmp_path / "x" / "y")  # already there: fine
    (tmp_path / "f").write_text("")
    with pytest.raises(PlatformError, match="cannot create the directory"):
        ensure_dir(tmp_path / "f" / "sub")
    assert remove(tmp_path / "f") and not remove(tmp_path / "f")
    with pytest.raises(PlatformError, match="cannot remove"):
        remove(tmp_path / "x")  # a directory


def test_mps_grants_are_written_atomically_and_a_failure_is_a_reason(tmp_path: Path) -> None:
    grant = MpsGrant(0, partition_for(30, 132), 1024, Path("/p"), Path("/l"))
    path = tmp_path / "mps" / "grants.json"
    assert save_grants(path, {"u/c": grant}) is None  # its directory made on the way
    assert json.loads(path.read_text())["u/c"]["percent"] == grant.partition.percent
    assert load_grants(path) == ({"u/c": grant}, None)
    assert [p.name for p in path.parent.iterdir()] == ["grants.json"]
    assert load_grants(tmp_path / "none.json") == ({}, None)
    (tmp_path / "blocked").write_text("")
    problem = save_grants(tmp_path / "blocked" / "grants.json", {"u/c": grant})
    assert problem is not None and "cannot create the directory" in problem
    grants, problem = load_grants(tmp_path / "mps")  # a directory: unreadable, not an exception
    assert grants == {} and problem is not None and "cannot read" in problem


def test_a_cgroups_processes_and_freezer_are_read_behind_project_errors(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"
    procs.write_text("12\n34\n")
    assert read_pids(procs) == [12, 34]
    procs.write_text("12\nx\n")
    with pytest.raises(FreezerError, match="non-numeric"):
        read_pids(procs)
    with pytest.raises(CgroupGoneError):
        read_pids(tmp_path / "gone" / "cgroup.procs")
    with pytest.raises(FreezerError, match="cannot read"):
        read_pids(tmp_path)  # a directory
    with pytest.raises(CgroupGoneError, match="does not exist"):
        freezer_access(tmp_path / "gone")
    assert freezer_access(tmp_path) is None  # neither cgroup.freeze nor freezer.state
    (tmp_path / "cgroup.freeze").write_text("0\n")
    assert freezer_access(tmp_path) == (tmp_path / "cgroup.freeze", True)
