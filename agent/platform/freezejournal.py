"""The freeze journal: everything the agent may have paused, on disk before the first pause.

An actuator adds a cgroup (or process identities) to the journal *before* freezing
(stopping) it and removes it only after thawing, so the file is always a superset of
what is paused. When the agent dies, the watchdog process, and the next agent at
start-up, thaw everything listed (``thaw_everything``).

The document (version 1)::

    {"version": 1, "agentPid": 1234,
     "cgroups": ["/sys/fs/cgroup/.../cri-containerd-<id>.scope", ...],
     "processes": [{"pid": 4321, "startTicks": 98765, "key": "ns/pod/container"}, ...]}

Writes replace the file atomically (:func:`agent.platform.atomicfile.write_atomic`), only
when the content changes. A write that fails (the disk is full, the directory read-only) raises
``JournalError`` and changes nothing, in the file or in memory: the caller must then not
pause what it meant to add (``FreezerActuator`` does not freeze); ``write_error`` says why
until a write succeeds again. No fsync (``durable=False``): the control loop writes it before
a first freeze, the journal guards against the agent dying, not the machine, and after a
reboot nothing is frozen anyway (the state dir is a tmpfs under /run).

This module runs inside the watchdog process: stdlib and agent.platform only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import PlatformError
from agent.platform.atomicfile import ensure_dir, write_atomic
from agent.platform.cgroups.freezer import CgroupGoneError, FreezerError, set_frozen
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.platform.procsignal import SignalOutcome, signal_identity

log = logging.getLogger(__name__)

VERSION = 1


class JournalError(PlatformError):
    """The journal could not be written: nothing may be paused until it can."""


@dataclass(frozen=True, order=True)
class JournalProcess:
    """A process some actuator may have stopped, with the container it belonged to."""

    pid: int
    start_ticks: int
    key: str  # "namespace/pod/container"

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_ticks)


@dataclass(frozen=True)
class JournalEntries:
    cgroups: tuple[Path, ...] = ()
    processes: tuple[JournalProcess, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.cgroups and not self.processes


class FreezeJournal:
    """The journal file at ``path``; entries left by an earlier run are loaded (and kept)."""

    def __init__(self, path: Path, *, file_lock_held: bool = False) -> None:
        """``file_lock_held``: the caller holds ``file_lock(path)`` for this journal's lifetime."""
        self.path = path
        self._file_lock_held = file_lock_held
        self._lock = threading.Lock()
        self._cgroups: set[str] = set()
        self._processes: dict[str, set[ProcessIdentity]] = {}
        # What the file holds, to skip writes that change nothing; None: unknown or unreadable.
        self._on_disk: tuple[frozenset[str], frozenset[JournalProcess]] | None = None
        self._write_error: str | None = None
        self._load()

    @property
    def write_error(self) -> str | None:
        """Why the last write failed; None once one succeeds (or none failed)."""
        with self._lock:
            return self._write_error

    # -- changes -------------------------------------------------------------------

    def add_cgroup(self, cgroup_dir: Path) -> None:
        with self._lock:
            name = _absolute(cgroup_dir)
            if name not in self._cgroups:
                self._commit(self._cgroups | {name}, self._processes)

    def remove_cgroup(self, cgroup_dir: Path) -> None:
        with self._lock:
            name = _absolute(cgroup_dir)
            if name in self._cgroups:
                self._commit(self._cgroups - {name}, self._processes)

    def remove_cgroups(self, cgroup_dirs: Iterable[Path]) -> None:
        """Remove several in one write (a stop releases every container at once)."""
        with self._lock:
            names = {_absolute(c) for c in cgroup_dirs} & self._cgroups
            if names:
                self._commit(self._cgroups - names, self._processes)

    def add_processes(self, key: str, identities: Iterable[ProcessIdentity]) -> None:
        """Add ``identities`` to those recorded for ``key`` (a union)."""
        with self._lock:
            known = self._processes.get(key, set())
            new = set(identities)
            if not new <= known:
                self._commit(self._cgroups, {**self._processes, key: known | new})

    def replace_processes(self, key: str, identities: Iterable[ProcessIdentity]) -> None:
        """Record exactly ``identities`` for ``key``: the caller vouches that no other
        process of ``key`` is stopped. Keeps the list from growing with exited processes."""
        with self._lock:
            new = set(identities)
            if new != self._processes.get(key, set()):
                processes = {k: v for k, v in self._processes.items() if k != key}
                if new:
                    processes[key] = new
                self._commit(self._cgroups, processes)

    def remove_processes(self, key: str) -> None:
        with self._lock:
            if key in self._processes:
                self._commit(self._cgroups, {k: v for k, v in self._processes.items() if k != key})

    def clear(self) -> None:
        with self._lock:
            self._commit(set(), {})

    def keep_only(self, cgroups: Iterable[Path], processes: Iterable[JournalProcess]) -> None:
        """Replace the whole content in one write (``thaw_everything`` keeps what it could not thaw)."""
        with self._lock:
            by_key: dict[str, set[ProcessIdentity]] = {}
            for process in processes:
                by_key.setdefault(process.key, set()).add(process.identity)
            self._commit({_absolute(c) for c in cgroups}, by_key)

    # -- reading -------------------------------------------------------------------

    def has_cgroup(self, cgroup_dir: Path) -> bool:
        with self._lock:
            return _absolute(cgroup_dir) in self._cgroups

    def entries(self) -> JournalEntries:
        with self._lock:
            return JournalEntries(
                tuple(Path(c) for c in sorted(self._cgroups)),
                tuple(sorted(_flatten(self._processes))),
            )

    # -- the file ------------------------------------------------------------------

    def _commit(self, cgroups: set[str], processes: dict[str, set[ProcessIdentity]]) -> None:
        """Write the new content, then adopt it; on failure nothing changes (JournalError)."""
        content = (frozenset(cgroups), frozenset(_flatten(processes)))
        if content != self._on_disk:
            self._write(content)
        self._cgroups = set(cgroups)
        self._processes = {k: set(v) for k, v in processes.items() if v}

    def _write(self, content: tuple[frozenset[str], frozenset[JournalProcess]]) -> None:
        cgroups, processes = content
        document = {
            "version": VERSION,
            "agentPid": os.getpid(),
            "cgroups": sorted(cgroups),
            "processes": [
                {"pid": p.pid, "startTicks": p.start_ticks, "key": p.key} for p in sorted(processes)
            ],
        }
        text = json.dumps(document) + "\n"  # no indent: the C encoder, several times faster
        try:
            if not self.path.parent.is_dir():
                # whatever the umask: the watchdog reads it as root anyway
                ensure_dir(self.path.parent, mode=0o755)
            with nullcontext() if self._file_lock_held else file_lock(self.path):
                write_atomic(self.path, text.encode(), durable=False)
        except (OSError, PlatformError) as err:
            cause = err.__cause__ if isinstance(err, PlatformError) and err.__cause__ else err
            message = f"cannot write the freeze journal {self.path}: {cause}"
            if self._write_error is None:
                log.error("%s; nothing more is paused until it can be written", message)
            self._write_error = message
            raise JournalError(message) from err
        if self._write_error is not None:
            log.warning("the freeze journal %s can be written again", self.path)
            self._write_error = None
        self._on_disk = content

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            self._on_disk = (frozenset(), frozenset())
            return
        except (OSError, UnicodeDecodeError) as err:
            log.warning("freeze journal %s is unreadable, treated as empty: %s", self.path, err)
            return
        try:
            cgroups, processes = _parse(text)
        except ValueError as err:
            log.warning("freeze journal %s is corrupt, treated as empty: %s", self.path, err)
            return
        self._cgroups = cgroups
        for process in processes:
            self._processes.setdefault(process.key, set()).add(process.identity)
        self._on_disk = (frozenset(cgroups), frozenset(processes))


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on ``<journal>.lock``: writers in different processes (the agent,
    its watchdog, a restarted agent's start-up thaw) never overwrite each other's entries."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _absolute(cgroup_dir: Path) -> str:
    if not cgroup_dir.is_absolute():
        raise JournalError(f"the freeze journal takes absolute cgroup paths, not {cgroup_dir}")
    return str(cgroup_dir)


def _flatten(processes: dict[str, set[ProcessIdentity]]) -> list[JournalProcess]:
    return [JournalProcess(i.pid, i.start_ticks, key) for key, ids in processes.items() for i in ids]


def _is_path(item: object) -> bool:
    """An absolute path open() accepts: a NUL or an unencodable character would make the
    watchdog's thaw fail on this entry with ValueError instead of thawing the rest."""
    if not isinstance(item, str) or not item.startswith("/") or "\0" in item:
        return False
    try:
        os.fsencode(item)
    except UnicodeEncodeError:
        return False
    return True


def _parse(text: str) -> tuple[set[str], list[JournalProcess]]:
    """The journal's entries; ValueError for a document that cannot be trusted at all.

    A single malformed entry is skipped with a warning, the rest still count: losing
    one entry is better than losing all of them.
    """
    try:
        document: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise ValueError(f"not JSON ({err})") from err
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    if document.get("version") != VERSION:
        raise ValueError(f"unknown version {document.get('version')!r} (this agent writes {VERSION})")
    raw_cgroups = document.get("cgroups", [])
    raw_processes = document.get("processes", [])
    if not isinstance(raw_cgroups, list) or not isinstance(raw_processes, list):
        raise ValueError("'cgroups' and 'processes' must be lists")
    cgroups: set[str] = set()
    for item in raw_cgroups:
        if _is_path(item):
            cgroups.add(item)
        else:
            log.warning("freeze journal: skipping cgroup entry %r (not a usable absolute path)", item)
    processes: list[JournalProcess] = []
    for item in raw_processes:
        try:
            pid, start, key = item["pid"], item["startTicks"], item.get("key", "")
        except (TypeError, KeyError):
            log.warning("freeze journal: skipping process entry %r (needs pid and startTicks)", item)
            continue
        if type(pid) is int and type(start) is int and isinstance(key, str) and pid > 1 and start >= 0:
            processes.append(JournalProcess(pid, start, key))
        else:
            log.warning("freeze journal: skipping process entry %r (bad pid, startTicks or key)", item)
    return cgroups, processes


@dataclass
class ThawReport:
    """What ``thaw_everything`` did; ``messages`` holds one line per entry handled."""

    cgroups_thawed: int = 0
    cgroups_gone: int = 0  # their directory no longer exists: nothing left to thaw
    processes_continued: int = 0
    processes_gone: int = 0  # exited
    processes_reused: int = 0  # the pid belongs to another process now: not signalled
    failures: int = 0  # kept in the journal for the next attempt
    messages: list[str] = field(default_factory=list)

    @property
    def found(self) -> int:
        """How many journal entries there were (0: nothing was left paused)."""
        return (
            self.cgroups_thawed
            + self.cgroups_gone
            + self.processes_continued
            + self.processes_gone
            + self.processes_reused
            + self.failures
        )

    def summary(self) -> str:
        return (
            f"thawed {self.cgroups_thawed} cgroup(s) ({self.cgroups_gone} gone), continued "
            f"{self.processes_continued} process(es) ({self.processes_gone} gone, "
            f"{self.processes_reused} pid(s) reused, skipped), {self.failures} failure(s)"
        )


def thaw_everything(path: Path, procfs: ProcFS | None = None) -> ThawReport:
    """Thaw every cgroup and continue every process in the journal at ``path``, then clear it.

    For the agent's start-up and the watchdog. Never raises for a single entry: each
    failure is logged, counted, and its entry stays in the journal so the next attempt
    retries it. Cgroups are thawed before processes are continued: a SIGCONT to a
    process in a frozen cgroup would only take effect at the thaw anyway.
    """
    procfs = procfs or ProcFS()
    report = ThawReport()
    if not path.parent.is_dir():
        return report  # nothing was ever journaled there
    with ExitStack() as stack:
        # Held from reading to rewriting: a new agent starting meanwhile waits for us.
        try:
            stack.enter_context(file_lock(path))
        except OSError as err:  # thawing matters more than the lock
            log.warning("cannot lock the freeze journal %s, thawing anyway: %s", path, err)
        _thaw(FreezeJournal(path, file_lock_held=True), procfs, report)
    return report


def _thaw(journal: FreezeJournal, procfs: ProcFS, report: ThawReport) -> None:
    entries = journal.entries()
    failed_cgroups: list[Path] = []
    failed_processes: list[JournalProcess] = []

    def note(level: int, message: str) -> None:
        report.messages.append(message)
        log.log(level, "%s", message)

    for cgroup in entries.cgroups:
        try:
            set_frozen(cgroup, False)
        except CgroupGoneError:
            report.cgroups_gone += 1
            note(logging.DEBUG, f"cgroup {cgroup} is gone")
        except FreezerError as err:
            report.failures += 1
            failed_cgroups.append(cgroup)
            note(logging.WARNING, f"cannot thaw cgroup {cgroup}: {err}")
        else:
            report.cgroups_thawed += 1
            note(logging.INFO, f"thawed cgroup {cgroup}")

    for process in entries.processes:
        where = f"pid {process.pid} ({process.key or 'unknown container'})"
        try:
            outcome = signal_identity(process.identity, signal.SIGCONT, procfs)
        except PlatformError as err:  # SignalError, or /proc unreadable
            report.failures += 1
            failed_processes.append(process)
            note(logging.WARNING, f"cannot continue {where}: {err}")
            continue
        if outcome is SignalOutcome.SENT:
            report.processes_continued += 1
            note(logging.INFO, f"continued {where}")
        elif outcome is SignalOutcome.REUSED:
            report.processes_reused += 1
            note(logging.INFO, f"{where}: pid reused by another process, not signalled")
        else:
            report.processes_gone += 1
            note(logging.DEBUG, f"{where}: {outcome.value}")

    try:
        journal.keep_only(failed_cgroups, failed_processes)
    except JournalError as err:
        report.failures += 1
        note(logging.WARNING, f"cannot rewrite the freeze journal: {err}")
