"""/proc/<pid>/stat parsing and process identity, on a fake tree and on the real /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.errors import PlatformError, ProcessGoneError
from agent.platform.procfs import ProcessIdentity, ProcFS, ProcStat, parse_stat


def stat_line(
    pid: int,
    comm: str,
    *,
    state: str = "S",
    ppid: int | str = 1,
    utime: int | str = 11,
    stime: int | str = 22,
    start: int | str = 123456,
) -> str:
    # Fields after comm: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime vsize rss ...
    after = [state, ppid, pid, pid, 0, -1, 4194560, 100, 0, 0, 0, utime, stime, 0, 0, 20, 0, 1, 0, start]
    after += [12345678, 456, 18446744073709551615]
    return f"{pid} ({comm}) " + " ".join(map(str, after)) + "\n"


@pytest.mark.parametrize(
    "comm",
    ["python3", "my prog", "a) b", "((x))", ") S 1 2 3", "", "name with ) and ( and  spaces"],
)
def test_parse_stat_comm_with_spaces_and_parentheses(comm: str) -> None:
    stat = parse_stat(42, stat_line(42, comm, state="R", ppid=7, utime=100, stime=50, start=987654))
    assert stat == ProcStat(
        pid=42, comm=comm, state="R", ppid=7, utime_ticks=100, stime_ticks=50, start_ticks=987654
    )
    assert stat.cpu_ticks == 150
    assert stat.identity == ProcessIdentity(42, 987654)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("42 python S 1 2 3", id="no-parentheses"),
        pytest.param("42 )python( S 1", id="parentheses-reversed"),
        pytest.param("42 (python) S 1 2 3 4 5", id="too-few-fields"),
        pytest.param(stat_line(42, "p", ppid="x"), id="non-numeric-ppid"),
        pytest.param(stat_line(42, "p", utime="1.5"), id="non-numeric-utime"),
        pytest.param(stat_line(42, "p", start="later"), id="non-numeric-start"),
    ],
)
def test_parse_stat_malformed(text: str) -> None:
    with pytest.raises(PlatformError, match="/proc/42/stat"):
        parse_stat(42, text)


def write_stat(root: Path, pid: int, state: str = "S", start: int = 777, **fields: int) -> None:
    (root / str(pid)).mkdir(exist_ok=True)
    (root / str(pid) / "stat").write_text(stat_line(pid, "worker (1)", state=state, start=start, **fields))


def test_fake_tree_stat_and_identity(tmp_path: Path) -> None:
    write_stat(tmp_path, 100, utime=5, stime=6, start=777)
    procfs = ProcFS(root=tmp_path)
    stat = procfs.stat(100)
    assert stat.comm == "worker (1)"
    assert stat.cpu_ticks == 11
    assert procfs.identity(100) == ProcessIdentity(100, 777)


def test_fake_tree_missing_process_is_gone(tmp_path: Path) -> None:
    with pytest.raises(ProcessGoneError, match="100"):
        ProcFS(root=tmp_path).stat(100)


def test_fake_tree_malformed_stat_is_a_platform_error(tmp_path: Path) -> None:
    (tmp_path / "100").mkdir()
    (tmp_path / "100" / "stat").write_text("garbage")
    with pytest.raises(PlatformError):
        ProcFS(root=tmp_path).stat(100)


def test_fake_tree_unreadable_stat_is_a_platform_error(tmp_path: Path) -> None:
    (tmp_path / "100" / "stat").mkdir(parents=True)  # a directory: read fails with EISDIR
    with pytest.raises(PlatformError, match="cannot read"):
        ProcFS(root=tmp_path).stat(100)


@pytest.mark.parametrize(
    ("state", "start", "alive"),
    [
        pytest.param("S", 777, True, id="sleeping-same-start"),
        pytest.param("R", 777, True, id="running-same-start"),
        pytest.param("D", 777, True, id="disk-sleep-same-start"),
        pytest.param("S", 778, False, id="pid-reused"),
        pytest.param("Z", 777, False, id="zombie"),
        pytest.param("X", 777, False, id="dead"),
    ],
)
def test_fake_tree_is_alive(tmp_path: Path, state: str, start: int, alive: bool) -> None:
    write_stat(tmp_path, 100, state=state, start=start)
    assert ProcFS(root=tmp_path).is_alive(ProcessIdentity(100, 777)) is alive


def test_fake_tree_is_alive_missing_process(tmp_path: Path) -> None:
    assert ProcFS(root=tmp_path).is_alive(ProcessIdentity(100, 777)) is False


def test_real_proc_for_this_process() -> None:
    procfs = ProcFS()
    pid = os.getpid()
    first = procfs.stat(pid)
    second = procfs.identity(pid)
    assert first.pid == pid
    assert first.ppid == os.getppid()
    assert first.identity == second
    assert first.start_ticks > 0
    assert first.cpu_ticks >= 0
    assert first.state in ("R", "S", "D")
    assert procfs.is_alive(second)
    assert not procfs.is_alive(ProcessIdentity(pid, second.start_ticks + 1))


def test_clock_ticks_per_second_is_positive() -> None:
    assert ProcFS.clock_ticks_per_second() > 0
