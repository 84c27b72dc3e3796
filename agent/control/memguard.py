"""GPU memory quotas: act on containers that hold more than their vcuda-memory.

The caller measures each container's processes every ``memory_check_s`` (more often near a
quota: :mod:`agent.domain.memcadence`) and calls :meth:`MemoryGuard.check`; the guard
judges (``agent.domain.memquota.judge``) and acts by mode:

- ``kill``: SIGKILL the process that went over, after checking that its pid still belongs
  to the process that was measured (pid + start time; through a pidfd where the kernel
  has them, so the pid cannot be reused between the check and the signal), then an Event
  ``GPUMemoryQuotaExceeded`` on the pod. A process is killed once; while a killed process
  is still listed, its container is left alone (its memory is released when it is gone).
- ``audit``: the Event and a log line once per episode (an episode ends when the container
  is back under quota).
- ``deny``: the quotas and measured use go to the BPF LSM program, which refuses
  allocations beyond the quota; a container over quota anyway is reported as in ``audit``.
  Without a program (BPF LSM unusable) or for a container whose cgroup id is unknown,
  ``deny`` acts as ``kill``.

No thread of its own; the guard is not thread-safe (one caller).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.clock import Clock
from agent.control.kubeports import EventSink
from agent.domain.memquota import ProcessUse, QuotaVerdict, judge
from agent.errors import PlatformError, ProcessGoneError, VcudaError
from agent.platform.bpf.lsm import LsmSupport, MemoryDenyProgram
from agent.platform.gpu.inventory import ProcessMemory
from agent.platform.kube.pods import PodInfo
from agent.platform.procfs import ProcessIdentity, ProcFS
from agent.platform.procsignal import SignalOutcome, signal_identity
from agent.settings import MemoryQuotaMode

log = logging.getLogger(__name__)

EVENT_REASON = "GPUMemoryQuotaExceeded"
KILLED, AUDIT, SKIPPED_REUSED, SKIPPED_PROTECTED, KILL_FAILED = (
    "killed",
    "audit",
    "skipped: pid reused",
    "skipped: protected pid",
    "skipped: kill failed",
)

Kill = Callable[[int, int], None]  # os.kill's signature


@dataclass(frozen=True)
class MemoryView:
    """One container's GPU memory at one check."""

    key: str  # namespace/pod/container (logs, status, episode tracking)
    pod: PodInfo | None  # the pod the Event goes to; None: no Event (no Kubernetes)
    quota_mib: int | None  # its vcuda-memory; None: no quota (whole GPUs)
    processes: Sequence[ProcessUse]
    cgroup_id: int | None = None  # v2 id of the cgroup its processes run in (mode deny)


@dataclass(frozen=True)
class GuardAction:
    """What the guard did, for the status command."""

    time: float  # wall clock
    key: str
    action: str  # "killed pid N", "audit", "skipped: pid reused", ...
    used_bytes: int
    quota_bytes: int
    pid: int | None = None


class DenyProgram(Protocol):
    """The part of :class:`MemoryDenyProgram` the guard uses."""

    def set_quota(self, cgroup_id: int, quota_bytes: int, used_bytes: int) -> None: ...

    def remove_quota(self, cgroup_id: int) -> None: ...


def open_deny_program(program: MemoryDenyProgram, support: LsmSupport) -> MemoryDenyProgram | None:
    """Start the LSM program for mode ``deny``; None (with one warning) when it cannot run,
    in which case the guard kills instead."""
    if not support.usable:
        log.warning(
            "memory mode deny is unavailable (%s); processes over quota are killed instead", support.reason
        )
        return None
    try:
        program.start()
    except PlatformError as err:
        log.warning("memory mode deny is unavailable (%s); processes over quota are killed instead", err)
        return None
    return program


class Identities(Protocol):
    """pid -> identity now; raises ProcessGoneError for a pid that is gone (ProcFS does this)."""

    def identity(self, pid: int) -> ProcessIdentity: ...


def process_uses(
    memory: Iterable[ProcessMemory],
    procfs: Identities,
    traced: Mapping[int, int] | None = None,
    last_alloc_ns: Mapping[int, int] | None = None,
) -> list[ProcessUse]:
    """One ProcessUse per pid: NVML bytes summed over GPUs, the identity read now (pids
    that exited meanwhile are left out), tracer bytes and allocation times where given.

    The identity is read after the measurement: a pid reused in that instant would be
    charged the old process's memory; grouping pids into containers by their cgroup (as
    the agent does) keeps such a stranger out of the container being judged.
    """
    per_pid: dict[int, int] = {}
    for m in memory:
        per_pid[m.pid] = per_pid.get(m.pid, 0) + m.used_bytes
    for pid in traced or {}:
        per_pid.setdefault(pid, 0)
    uses = []
    for pid, nvml in sorted(per_pid.items()):
        try:
            identity = procfs.identity(pid)
        except ProcessGoneError:
            continue
        uses.append(
            ProcessUse(
                identity,
                nvml,
                None if traced is None else traced.get(pid, 0),
                None if last_alloc_ns is None else last_alloc_ns.get(pid),
            )
        )
    return uses


class MemoryGuard:
    def __init__(
        self,
        *,
        mode: MemoryQuotaMode,
        procfs: ProcFS,
        clock: Clock,
        events: EventSink | None = None,
        own_pid: int | None = None,
        kill: Kill | None = None,
        deny: DenyProgram | None = None,
        history: int = 256,
    ) -> None:
        """``kill``: None signals through a pidfd (race-free, :mod:`agent.platform.procsignal`);
        tests inject a recorder.
        ``deny``: the started LSM program for mode ``deny`` (None: ``deny`` kills)."""
        self.mode = mode
        self._procfs = procfs
        self._clock = clock
        self._events = events
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._kill = kill
        self._deny = deny if mode is MemoryQuotaMode.DENY else None
        self.recent_actions: collections.deque[GuardAction] = collections.deque(maxlen=history)
        self._counts = {"kills": 0, "audits": 0, "skipped": 0}
        self._reported: set[str] = set()  # containers over quota whose episode was reported
        self._killed: set[ProcessIdentity] = set()  # signalled; may take a moment to die
        self._passed: set[ProcessIdentity] = set()  # not killed (reused, protected): said once
        self._denied: set[int] = set()  # cgroup ids in the LSM program's map
        self._deny_failed: set[int] = set()  # cgroup ids whose map update failed (logged once)
        self.over: set[str] = set()  # the containers over their quota at the last check

    def stats(self) -> dict[str, int]:
        """Counters by action, for metrics: kills, audits, skipped."""
        return dict(self._counts)

    def check(self, containers: Sequence[MemoryView], *, partial: bool = False) -> list[GuardAction]:
        """Judge every container once and act by mode; returns what was done. ``partial``:
        ``containers`` are only some of the node's (a check near a quota), so the state of
        those not given is kept."""
        done: list[GuardAction] = []
        seen_keys: set[str] = set()
        seen_cgroups: set[int] = set()
        for view in containers:
            if view.quota_mib is None:
                continue
            seen_keys.add(view.key)
            verdict = judge(view.quota_mib, view.processes)
            enforced_in_kernel = False
            if self._deny is not None and view.cgroup_id is not None:
                seen_cgroups.add(view.cgroup_id)
                enforced_in_kernel = self._update_deny(self._deny, view.cgroup_id, verdict)
            if not verdict.over:
                self._reported.discard(view.key)
                self.over.discard(view.key)
                continue
            self.over.add(view.key)
            if self.mode is MemoryQuotaMode.AUDIT or enforced_in_kernel:
                action = self._report_once(view, verdict)
            else:
                action = self._kill_culprit(view, verdict)
            if action is not None:
                done.append(action)
        if not partial:
            self.over &= seen_keys
            self._forget(containers, seen_keys, seen_cgroups)
        return done

    # -- modes --------------------------------------------------------------------------------

    def _update_deny(self, deny: DenyProgram, cgroup_id: int, verdict: QuotaVerdict) -> bool:
        """Hand the quota and the measured use to the LSM program; False: kill instead."""
        try:
            deny.set_quota(cgroup_id, verdict.quota_bytes, verdict.used_bytes)
        except PlatformError as err:
            if cgroup_id not in self._deny_failed:  # said once per cgroup, not every check
                self._deny_failed.add(cgroup_id)
                log.error(
                    "cannot set the memory quota of cgroup %d in the LSM program (%s); killing instead",
                    cgroup_id,
                    err,
                )
            return False
        self._deny_failed.discard(cgroup_id)
        self._denied.add(cgroup_id)
        return True

    def _report_once(self, view: MemoryView, verdict: QuotaVerdict) -> GuardAction | None:
        if view.key in self._reported:
            return None
        self._reported.add(view.key)
        what = (
            "memory mode audit: nothing was done"
            if self.mode is MemoryQuotaMode.AUDIT
            else "memory mode deny: further allocations are refused"
        )
        pid = verdict.culprit.pid if verdict.culprit else None
        return self._act(view, verdict, AUDIT, f"{verdict.reason} ({what})", pid, event=True)

    def _kill_culprit(self, view: MemoryView, verdict: QuotaVerdict) -> GuardAction | None:
        culprit = verdict.culprit
        if culprit is None or any(p.identity in self._killed for p in view.processes):
            return None  # nothing to blame, or a kill in progress: its memory is not released yet
        ident = culprit.identity
        if ident in self._passed:
            return None  # already said why it is not killed
        if ident.pid <= 1 or ident.pid == self._own_pid:
            self._passed.add(ident)
            message = f"{verdict.reason}; pid {ident.pid} is protected (init or the agent itself): not killed"
            return self._act(view, verdict, SKIPPED_PROTECTED, message, ident.pid, event=True)
        try:
            killed = self._signal(ident)
        except (OSError, PlatformError) as err:  # OSError: from an injected kill
            self._passed.add(ident)
            message = f"{verdict.reason}; killing pid {ident.pid} failed: {err}"
            return self._act(view, verdict, KILL_FAILED, message, ident.pid, event=False)
        if not killed:
            self._passed.add(ident)
            message = f"{verdict.reason}; pid {ident.pid} was reused/exited; not killed"
            return self._act(view, verdict, SKIPPED_REUSED, message, ident.pid, event=False)
        self._killed.add(ident)
        message = f"{verdict.reason}; killed pid {ident.pid} (SIGKILL)"
        return self._act(view, verdict, f"{KILLED} pid {ident.pid}", message, ident.pid, event=True)

    def _act(
        self,
        view: MemoryView,
        verdict: QuotaVerdict,
        action: str,
        message: str,
        pid: int | None,
        *,
        event: bool,
    ) -> GuardAction:
        log.warning("%s: %s", view.key, message)
        if event and self._events is not None and view.pod is not None:
            try:
                self._events.pod(view.pod, EVENT_REASON, message)
            except VcudaError as err:
                log.warning("%s: the %s Event was not recorded: %s", view.key, EVENT_REASON, err)
        counter = "kills" if action.startswith(KILLED) else "audits" if action == AUDIT else "skipped"
        self._counts[counter] += 1
        record = GuardAction(
            self._clock.wall(), view.key, action, verdict.used_bytes, verdict.quota_bytes, pid
        )
        self.recent_actions.append(record)
        return record

    # -- killing ------------------------------------------------------------------------------

    def _same_process(self, ident: ProcessIdentity) -> bool:
        try:
            return self._procfs.is_alive(ident)
        except PlatformError as err:
            log.warning("cannot check pid %d before killing it: %s", ident.pid, err)
            return False

    def _signal(self, ident: ProcessIdentity) -> bool:
        """SIGKILL ``ident`` if its pid still belongs to it; False when it exited or was reused;
        PlatformError when it could not be signalled.

        Without an injected ``kill`` this goes through a pidfd (:func:`signal_identity`): the
        pidfd is opened first, so when the start time still matches after that, the signal
        reaches the measured process whatever happens to the pid afterwards.
        """
        if self._kill is None:
            return signal_identity(ident, signal.SIGKILL, self._procfs) is SignalOutcome.SENT
        if not self._same_process(ident):
            return False
        try:
            self._kill(ident.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def _forget(self, containers: Sequence[MemoryView], keys: set[str], cgroups: set[int]) -> None:
        """Drop state of containers and processes that are gone."""
        self._reported &= keys
        self._deny_failed &= cgroups
        listed = {p.identity for view in containers for p in view.processes}
        for ident in [i for i in self._killed | self._passed if i not in listed]:
            if not self._same_process(ident):
                self._killed.discard(ident)
                self._passed.discard(ident)
        if self._deny is not None:
            for cgroup_id in self._denied - cgroups:
                try:
                    self._deny.remove_quota(cgroup_id)
                except PlatformError as err:
                    log.warning("cannot remove the memory quota of cgroup %d: %s", cgroup_id, err)
                    continue
                self._denied.discard(cgroup_id)
