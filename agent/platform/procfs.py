"""Reading /proc: process identity (pid + start time) and CPU time.

The root is injectable so tests can point it at a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.errors import PlatformError, ProcessGoneError

# Fields of /proc/<pid>/stat after the ")" that closes comm, 0-based:
# state=0 ppid=1 ... utime=11 stime=12 ... starttime=19.
_STATE, _PPID, _UTIME, _STIME, _STARTTIME = 0, 1, 11, 12, 19


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel knows it: a pid alone can be reused, pid + start time cannot."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    utime_ticks: int
    stime_ticks: int
    start_ticks: int

    @property
    def cpu_ticks(self) -> int:
        return self.utime_ticks + self.stime_ticks

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_ticks)


def parse_stat(pid: int, text: str) -> ProcStat:
    """Parse the text of /proc/<pid>/stat; comm may hold spaces and parentheses."""
    open_paren, close_paren = text.find("("), text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise PlatformError(f"/proc/{pid}/stat is malformed: {text[:80]!r}")
    fields = text[close_paren + 2 :].split()
    if len(fields) <= _STARTTIME:
        raise PlatformError(f"/proc/{pid}/stat has {len(fields)} fields after comm, expected > 19")
    try:
        return ProcStat(
            pid=pid,
            comm=text[open_paren + 1 : close_paren],
            state=fields[_STATE],
            ppid=int(fields[_PPID]),
            utime_ticks=int(fields[_UTIME]),
            stime_ticks=int(fields[_STIME]),
            start_ticks=int(fields[_STARTTIME]),
        )
    except ValueError as err:
        raise PlatformError(f"/proc/{pid}/stat has a non-numeric field: {err}") from err


class ProcFS:
    """Access to one /proc tree."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root
        self._prefix = f"{root}/"  # str paths: the agent reads thousands of stat files a second

    @staticmethod
    def clock_ticks_per_second() -> int:
        return os.sysconf("SC_CLK_TCK")

    def stat(self, pid: int) -> ProcStat:
        path = f"{self._prefix}{pid}/stat"
        try:
            with open(path, "rb") as f:
                text = f.read().decode(errors="replace")  # comm is arbitrary bytes
        except (FileNotFoundError, ProcessLookupError) as err:
            raise ProcessGoneError(f"process {pid} has exited") from err
        except OSError as err:
            raise PlatformError(f"cannot read {path}: {err}") from err
        return parse_stat(pid, text)

    def identity(self, pid: int) -> ProcessIdentity:
        return self.stat(pid).identity

    def is_alive(self, identity: ProcessIdentity) -> bool:
        """True when ``identity.pid`` still runs the same process (not a reused pid, not a zombie)."""
        try:
            stat = self.stat(identity.pid)
        except ProcessGoneError:
            return False
        return stat.start_ticks == identity.start_ticks and stat.state not in ("Z", "X")

    def real_uid(self, pid: int) -> int:
        """The process's real user id (``Uid:`` in /proc/<pid>/status)."""
        return self.uids(pid)[0]

    def uids(self, pid: int) -> tuple[int, ...]:
        """The process's real, effective, saved and filesystem user ids (``Uid:`` in
        /proc/<pid>/status): a process may switch to any of them without privilege."""
        path = self.root / str(pid) / "status"
        try:
            text = path.read_text()
        except FileNotFoundError as err:
            raise ProcessGoneError(f"process {pid} has exited") from err
        except OSError as err:
            raise PlatformError(f"cannot read {path}: {err}") from err
        for line in text.splitlines():
            if line.startswith("Uid:"):
                fields = line.split()[1:]
                if fields and all(f.isdigit() for f in fields):
                    return tuple(int(f) for f in fields)
        raise PlatformError(f"{path} has no Uid: line")
