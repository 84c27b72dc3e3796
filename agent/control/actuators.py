"""Actuators: how a throttled container is paused between its duty-cycle slices.

- ``FreezerActuator``: the cgroup freezer (v2 cgroup.freeze, v1 freezer.state); the
  whole container stops at once, including processes it forks meanwhile.
- ``SignalActuator``: SIGSTOP/SIGCONT to the container's processes, for hosts where the
  freezer file is missing or read-only. Only processes it stopped itself are continued,
  each checked by pid + start time through a pidfd (procsignal), so a reused pid is
  never signalled.
- ``AutoActuator``: the freezer where it is writable, else signals, decided per target.

A container its runtime has paused (``ctr task pause``, ``crictl``/Docker pause: the same
freezer file) is left alone by the freezer actuator: not frozen, not journaled, never thawed by
the agent, until the runtime resumes it. One pause that lands inside one of the agent's own
freeze slices cannot be told apart from it and is undone by that slice's thaw.

Every actuator records what it is about to pause in the freeze journal *before*
pausing it, so the watchdog (or the next start) can undo it if the agent dies. All
methods are thread-safe and raise FreezerError (a PlatformError) on real failures; a
container that is gone is not a failure when thawing or releasing it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.errors import PlatformError, ProcessGoneError
from agent.platform.cgroups.freezer import CgroupGoneError, FreezerError, OpenFreezers, freezer_access
from agent.platform.cgroups.procs import read_pids
from agent.platform.freezejournal import FreezeJournal
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.platform.procsignal import SignalOutcome, signal_identity
from agent.settings import ActuatorMode

log = logging.getLogger(__name__)

# Processes forked while a container is being stopped escape one pass; a few re-reads
# of cgroup.procs catch them (the rest are stopped at the next freeze).
_STOP_PASSES = 3


@dataclass(frozen=True)
class ThrottleTarget:
    key: str  # "namespace/pod/container", for logs
    cgroup_dir: Path | None  # its v2 scope dir, or its dir in the v1 freezer hierarchy; None if unknown
    procs_file: Path | None  # a cgroup.procs listing its processes (any hierarchy), for signals


class Actuator(Protocol):
    name: str  # "freezer" | "signals" | "auto"

    def freeze(self, target: ThrottleTarget) -> None: ...

    def thaw(self, target: ThrottleTarget) -> None: ...

    def release(self, target: ThrottleTarget) -> None:
        """Thaw and drop from the journal (no longer throttled, or gone)."""
        ...

    def release_all(self) -> None:
        """Thaw everything this actuator paused; its journal entries are removed."""
        ...


class FreezerActuator:
    name = "freezer"

    def __init__(self, journal: FreezeJournal) -> None:
        self._journal = journal
        self._lock = threading.Lock()
        self._journaled: set[Path] = set()  # dirs this actuator put in the journal
        self._frozen: set[Path] = set()  # dirs this actuator froze and has not thawed yet
        self._left_paused: set[Path] = set()  # dirs found paused by their runtime: not touched
        self._files = OpenFreezers()

    def freeze(self, target: ThrottleTarget) -> None:
        cgroup_dir = _cgroup_dir(target)
        with self._lock:
            if cgroup_dir not in self._frozen and self._paused_by_runtime(cgroup_dir, target.key):
                return
            if cgroup_dir not in self._journaled:
                self._journal.add_cgroup(cgroup_dir)  # before the first freeze, always
                self._journaled.add(cgroup_dir)
            try:
                self._files.set(cgroup_dir, True)
            except CgroupGoneError:
                self._forget(cgroup_dir)
                raise
            self._frozen.add(cgroup_dir)

    def thaw(self, target: ThrottleTarget) -> None:
        cgroup_dir = _cgroup_dir(target)
        with self._lock:
            if cgroup_dir not in self._left_paused:
                self._thaw(cgroup_dir, target.key)

    def release(self, target: ThrottleTarget) -> None:
        cgroup_dir = _cgroup_dir(target)
        with self._lock:
            if cgroup_dir not in self._left_paused:
                self._thaw(cgroup_dir, target.key)
            self._forget(cgroup_dir)
            self._left_paused.discard(cgroup_dir)

    def _paused_by_runtime(self, cgroup_dir: Path, key: str) -> bool:
        """Frozen while this actuator holds it thawed: its runtime paused it. Left paused (and out
        of the journal, so no watchdog thaws it) until it is found thawed again."""
        if cgroup_dir not in self._journaled and self._journal.has_cgroup(cgroup_dir):
            return False  # a predecessor froze it and its thaw failed: the agent's to undo
        try:
            frozen = self._files.requested(cgroup_dir)  # once per slice: on the open file
        except CgroupGoneError:
            return False  # the freeze below says so
        if not frozen:
            if cgroup_dir in self._left_paused:
                self._left_paused.discard(cgroup_dir)
                log.info("%s: resumed by its container runtime; throttling again", key)
            return False
        if cgroup_dir not in self._left_paused:
            self._forget(cgroup_dir)
            self._left_paused.add(cgroup_dir)
            log.info("%s: paused by its container runtime; left paused, the agent does not thaw it", key)
        return True

    def release_all(self) -> None:
        with self._lock:
            # The journal's own list too: entries a caller added without going through us.
            dirs = (self._journaled | set(self._journal.entries().cgroups)) - self._left_paused
            failures = []
            thawed = []
            for cgroup_dir in sorted(dirs):
                try:
                    self._thaw(cgroup_dir, str(cgroup_dir))
                    thawed.append(cgroup_dir)
                except PlatformError as err:
                    failures.append(str(err))
            # Out of the journal in one write once thawed (an entry kept a moment longer only
            # has the watchdog thaw a thawed cgroup again): not one write per container.
            self._journal.remove_cgroups(thawed)
            for cgroup_dir in thawed:
                self._frozen.discard(cgroup_dir)
                self._journaled.discard(cgroup_dir)
                self._files.close(cgroup_dir)
            if failures:
                raise FreezerError(f"could not release {len(failures)} cgroup(s): {'; '.join(failures)}")

    def _thaw(self, cgroup_dir: Path, key: str) -> None:
        self._frozen.discard(cgroup_dir)
        try:
            self._files.set(cgroup_dir, False)
        except CgroupGoneError:
            log.debug("%s: cgroup %s is gone, nothing to thaw", key, cgroup_dir)
            self._forget(cgroup_dir)

    def _forget(self, cgroup_dir: Path) -> None:
        self._frozen.discard(cgroup_dir)
        self._journal.remove_cgroup(cgroup_dir)
        self._journaled.discard(cgroup_dir)
        self._files.close(cgroup_dir)


class SignalActuator:
    name = "signals"

    def __init__(self, journal: FreezeJournal, procfs: ProcFS | None = None) -> None:
        self._journal = journal
        self._procfs = procfs or ProcFS()
        self._lock = threading.Lock()
        self._stopped: dict[str, set[ProcessIdentity]] = {}  # per key: SIGSTOPped, not yet continued

    def freeze(self, target: ThrottleTarget) -> None:
        procs_file = _procs_file(target)
        with self._lock:
            stopped = self._stopped.setdefault(target.key, set())
            seen: set[int] = set()
            failures: list[str] = []
            for _ in range(_STOP_PASSES):
                batch = self._identities(procs_file, skip=seen)
                if not batch:
                    break
                seen.update(identity.pid for identity in batch)
                # Journal first: it must hold everything that may be stopped. Replacing
                # (not adding) keeps it from growing with the container's exited processes.
                self._journal.replace_processes(target.key, stopped | batch)
                for identity in sorted(batch, key=lambda i: i.pid):
                    try:
                        outcome = signal_identity(identity, signal.SIGSTOP, self._procfs)
                    except PlatformError as err:
                        failures.append(str(err))
                        continue
                    if outcome is SignalOutcome.SENT:
                        stopped.add(identity)
            if failures:
                raise FreezerError(f"{target.key}: could not stop {len(failures)} process(es): {failures[0]}")

    def thaw(self, target: ThrottleTarget) -> None:
        with self._lock:
            self._continue(target.key)

    def release(self, target: ThrottleTarget) -> None:
        with self._lock:
            self._release(target.key)

    def release_all(self) -> None:
        with self._lock:
            failures = []
            for key in sorted(self._stopped):
                try:
                    self._release(key)
                except PlatformError as err:
                    failures.append(str(err))
            # Whatever is left in the journal was never ours in this run (an earlier run's,
            # if start-up thaw was skipped): continue it, identity-checked, and drop it.
            leftovers: dict[str, set[ProcessIdentity]] = {}
            for process in self._journal.entries().processes:
                if process.key in self._stopped:
                    continue  # ours, its release failed above
                leftovers.setdefault(process.key, set()).add(process.identity)
            for key, identities in sorted(leftovers.items()):
                self._stopped[key] = identities
                try:
                    self._release(key)
                except PlatformError as err:
                    failures.append(str(err))
            if failures:
                raise FreezerError(f"could not release {len(failures)} container(s): {'; '.join(failures)}")

    def stopped(self, key: str) -> frozenset[ProcessIdentity]:
        """The identities stopped for ``key`` and not yet continued (for tests and status)."""
        with self._lock:
            return frozenset(self._stopped.get(key, ()))

    def _continue(self, key: str) -> None:
        stopped = self._stopped.get(key)
        if not stopped:
            return
        failures = []
        for identity in sorted(stopped, key=lambda i: i.pid):
            try:
                signal_identity(identity, signal.SIGCONT, self._procfs)  # re-checks the start time
            except PlatformError as err:
                failures.append(str(err))
                continue
            stopped.discard(identity)  # continued, exited, or its pid reused: no longer ours
        if failures:
            raise FreezerError(f"{key}: could not continue {len(failures)} process(es): {failures[0]}")

    def _release(self, key: str) -> None:
        self._continue(key)  # raises, leaving the journal entry, when something stays stopped
        self._journal.remove_processes(key)
        self._stopped.pop(key, None)

    def _identities(self, procs_file: Path, skip: set[int]) -> set[ProcessIdentity]:
        me = os.getpid()
        found = set()
        for pid in read_pids(procs_file):
            if pid <= 1 or pid == me or pid in skip:
                continue
            try:
                found.add(self._procfs.identity(pid))
            except ProcessGoneError:
                continue
        return found


class AutoActuator:
    """The freezer for targets whose freezer file is writable, signals for the others."""

    name = "auto"

    def __init__(self, journal: FreezeJournal, procfs: ProcFS | None = None) -> None:
        self.freezer = FreezerActuator(journal)
        self.signals = SignalActuator(journal, procfs)
        self._lock = threading.Lock()
        self._chosen: dict[ThrottleTarget, FreezerActuator | SignalActuator] = {}

    def mechanism(self, target: ThrottleTarget) -> str | None:
        """ "freezer" or "signals" once ``target`` has been acted on, else None."""
        with self._lock:
            chosen = self._chosen.get(target)
        return chosen.name if chosen else None

    def freeze(self, target: ThrottleTarget) -> None:
        self._choose(target).freeze(target)

    def thaw(self, target: ThrottleTarget) -> None:
        with self._lock:
            chosen = self._chosen.get(target)
        if chosen is not None:  # never frozen through us: nothing to thaw
            chosen.thaw(target)

    def release(self, target: ThrottleTarget) -> None:
        with self._lock:
            chosen = self._chosen.pop(target, None)
        if chosen is not None:  # never acted on: nothing of it is paused
            chosen.release(target)

    def release_all(self) -> None:
        with self._lock:
            self._chosen.clear()
        failures = []
        for actuator in (self.freezer, self.signals):
            try:
                actuator.release_all()
            except PlatformError as err:
                failures.append(str(err))
        if failures:
            raise FreezerError("; ".join(failures))

    def _choose(self, target: ThrottleTarget) -> FreezerActuator | SignalActuator:
        with self._lock:
            chosen = self._chosen.get(target)
            if chosen is None:
                chosen, why = self._decide(target)
                self._chosen[target] = chosen
                log.info("%s: paused with %s (%s)", target.key, chosen.name, why)
            return chosen

    def _decide(self, target: ThrottleTarget) -> tuple[FreezerActuator | SignalActuator, str]:
        if target.cgroup_dir is None:
            return self.signals, "its cgroup directory is unknown"
        try:
            found = freezer_access(target.cgroup_dir)
        except CgroupGoneError as err:  # not created yet or already removed: decide later
            raise CgroupGoneError(f"{target.key}: {err}") from err
        if found is None:
            return self.signals, f"{target.cgroup_dir} has no cgroup.freeze or freezer.state"
        path, writable = found
        if not writable:
            return self.signals, f"{path} is not writable"
        return self.freezer, f"{path} is writable"


def make_actuator(mode: ActuatorMode, journal: FreezeJournal, procfs: ProcFS | None = None) -> Actuator:
    if mode is ActuatorMode.FREEZER:
        return FreezerActuator(journal)
    if mode is ActuatorMode.SIGNALS:
        return SignalActuator(journal, procfs)
    return AutoActuator(journal, procfs)


def _cgroup_dir(target: ThrottleTarget) -> Path:
    if target.cgroup_dir is None:
        raise FreezerError(f"{target.key}: no cgroup directory known, the freezer cannot act")
    return target.cgroup_dir


def _procs_file(target: ThrottleTarget) -> Path:
    if target.procs_file is None:
        raise FreezerError(f"{target.key}: no cgroup.procs known, its processes cannot be signalled")
    return target.procs_file
