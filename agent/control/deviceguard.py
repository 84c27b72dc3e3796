"""The device guard: keeps every container's NVIDIA device rules in place.

Each pass takes the desired targets (one per container: its pod, its GPU minors or
"no GPU"), resolves each container's cgroup, and makes the rules hold through a
``DeviceRules`` mechanism (v1 devices.deny or the v2 BPF program): new containers get
rules, existing ones are verified and repaired (a runtime update may have detached the
program) at the cgroup they were found in, without resolving it again; containers that
are no longer targets get their rules taken back. A container whose cgroup does not
exist yet is *pending*; a failure on one container never stops the others, and each
problem is logged once, not every pass.

Modes: ``enforce`` (default); ``audit`` changes no access: it logs what would be
denied, and on cgroup v2 attaches the program in counting-only mode so the attempts
themselves are counted; ``off`` does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.errors import VcudaError
from agent.platform.cgroups.devicepolicy import (
    DevicePolicy,
    DeviceRules,
    GuardError,
    Outcome,
    read_nvidia_majors,
)
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.layout import CgroupLayout, CgroupMode
from agent.platform.cgroups.paths import CgroupResolver, QosClass, bare_container_id
from agent.settings import GuardMode

log = logging.getLogger(__name__)


class TargetsNotReadyError(VcudaError):
    """The target list cannot be known yet (the pod cache has not synced): skip the pass."""


DEFAULT_INTERVAL_S = 2.0


@dataclass(frozen=True)
class GuardTarget:
    """One container the guard is responsible for."""

    pod_uid: str
    qos: QosClass | str | None  # the pod's QoS class; None (unknown): every class is tried
    container_id: str  # with or without the runtime scheme ("containerd://...")
    gpu_minors: frozenset[int] | None  # its /dev/nvidiaN minors; None: the pod has no GPU
    label: str  # "namespace/pod/container", for logs and metrics
    cap_minors: frozenset[int] = frozenset()  # its MIG devices' /dev/nvidia-caps minors

    @property
    def key(self) -> tuple[str, str]:
        return self.pod_uid, bare_container_id(self.container_id)

    @property
    def policy(self) -> DevicePolicy:
        return DevicePolicy(self.gpu_minors, self.cap_minors)


@dataclass
class ReconcileReport:
    """What one pass did; each list holds target labels (errors hold messages)."""

    applied: list[str] = field(default_factory=list)
    reattached: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)  # cgroup not there (yet)
    errors: list[str] = field(default_factory=list)
    unchanged: int = 0  # verified in place
    duration_s: float = 0.0


@dataclass(frozen=True)
class GuardStats:
    """Counters for metrics."""

    mode: GuardMode
    mechanism: str  # "cgroup v1 devices", "cgroup v2 bpf", "none"
    guarded: int  # targets whose rules are in place now
    pending: int
    reattachments: int  # total rule repairs after a runtime undid them
    errors: int  # total failed attempts (a persistent problem counts once per pass)
    passes: int
    denied: dict[str, int]  # label → accesses denied (v2 only; audit: would have been)


def default_rules(layout: CgroupLayout, bpf_dir: Path | None = None) -> DeviceRules:
    """The mechanism the runtime itself uses: v1 devices where mounted, else the v2 program
    (``bpf_dir/device_guard.c``; None: the sources next to the package)."""
    if "devices" in layout.v1_roots and layout.mode != CgroupMode.V2:
        return V1DeviceRules()
    return BpfDeviceRules() if bpf_dir is None else BpfDeviceRules(source_path=bpf_dir / "device_guard.c")


@dataclass
class _Guarded:
    target: GuardTarget
    scope: Path


class DeviceGuard:
    """Reconciles device rules for the targets ``targets()`` returns (see the module docstring)."""

    def __init__(
        self,
        targets: Callable[[], Iterable[GuardTarget]],
        resolver: CgroupResolver,
        rules: DeviceRules,
        *,
        mode: GuardMode = GuardMode.ENFORCE,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Clock | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._targets = targets
        self._resolver = resolver
        self._rules = rules
        self.mode = GuardMode(mode)
        self.interval_s = interval_s
        self._clock = clock or SystemClock()
        self._proc_root = proc_root
        self._guarded: dict[tuple[str, str], _Guarded] = {}
        self._pending: set[tuple[str, str]] = set()
        self._problems: dict[object, str] = {}  # what is wrong now, logged once
        self._reattachments = 0
        self._errors = 0
        self._passes = 0
        self._lock = threading.Lock()

    @property
    def _audit(self) -> bool:
        return self.mode == GuardMode.AUDIT

    @property
    def mechanism(self) -> str:
        if self.mode == GuardMode.OFF:
            return "none"
        return "cgroup v1 devices" if isinstance(self._rules, V1DeviceRules) else "cgroup v2 bpf"

    def run(self, stop: threading.Event) -> None:
        """Reconcile every ``interval_s`` until ``stop`` is set (a Supervisor task)."""
        while not stop.is_set():
            if self.mode != GuardMode.OFF:
                self.reconcile_once()
            if self._clock.sleep(self.interval_s, stop):
                break

    def reconcile_once(self) -> ReconcileReport:
        if self.mode == GuardMode.OFF:
            return ReconcileReport()
        with self._lock:
            return self._reconcile()

    def _reconcile(self) -> ReconcileReport:
        started = time.perf_counter()
        report = ReconcileReport()
        self._passes += 1
        try:
            desired = {t.key: t for t in self._targets()}
            self._rules.set_majors(read_nvidia_majors(self._proc_root))
        except TargetsNotReadyError as err:
            # Start-up, not a failure: nothing to apply yet, and nothing may be taken back.
            if self._problems.get("targets") != str(err):
                self._problems["targets"] = str(err)
                log.info("device guard pass skipped: %s", err)
            return report
        except VcudaError as err:
            # Without the desired set nothing may be removed: keep every rule as it is.
            self._fail("targets", f"device guard pass skipped: {err}", report)
            return report
        self._resolved("targets", "the target list")
        for key in [k for k in self._guarded if k not in desired]:
            self._take_back(key, report)
        for key, target in desired.items():
            self._apply(key, target, report)
        self._pending &= set(desired)
        report.duration_s = time.perf_counter() - started
        return report

    def _apply(self, key: tuple[str, str], target: GuardTarget, report: ReconcileReport) -> None:
        previous = self._guarded.get(key)
        if previous is not None and previous.target == target and self._verify(key, previous, report):
            return
        controller = self._rules.controller
        dirs = None
        try:
            dirs = self._resolver.container_dirs(target.pod_uid, target.qos, target.container_id, controller)
            if dirs is None:
                self._forget(key)
                report.pending.append(target.label)
                if key not in self._pending:
                    self._pending.add(key)
                    log.debug("device guard: %s has no cgroup yet", target.label)
                return
            root = self._resolver.kubepods_root(controller)
            if not dirs.scope.is_relative_to(root):  # a guard against a resolver bug: never stray
                raise GuardError(f"{dirs.scope} is outside {root}; not touching it")
            self._pending.discard(key)
            if previous is not None and previous.scope != dirs.scope:
                self._forget(key)
            outcome = self._rules.ensure(dirs.scope, target.policy, self._audit)
        except (VcudaError, ValueError) as err:
            if dirs is not None and not dirs.scope.is_dir():
                report.pending.append(target.label)  # the container went while we looked
                return
            self._fail(key, f"device guard: {target.label}: {err}", report)
            return
        self._record(key, _Guarded(target, dirs.scope), outcome, report)

    def _verify(self, key: tuple[str, str], guarded: _Guarded, report: ReconcileReport) -> bool:
        """A container guarded with the same target last pass: its rules are checked (and
        repaired) at the cgroup found then, without resolving the cgroup again (a container's
        cgroup keeps its path while it lives; the rules tell a re-created one by its inode).
        False where that fails (the cgroup went, say): the caller resolves it afresh."""
        try:
            outcome = self._rules.ensure(guarded.scope, guarded.target.policy, self._audit)
        except (VcudaError, ValueError):
            return False
        self._record(key, guarded, outcome, report)
        return True

    def _record(
        self, key: tuple[str, str], guarded: _Guarded, outcome: Outcome, report: ReconcileReport
    ) -> None:
        target = guarded.target
        self._guarded[key] = guarded
        self._resolved(key, target.label)
        if outcome == Outcome.APPLIED:
            report.applied.append(target.label)
            self._log_applied(target, guarded.scope)
        elif outcome == Outcome.REPAIRED:
            self._reattachments += 1
            report.reattached.append(target.label)
            log.warning("device guard: rules of %s were undone (runtime update?); restored", target.label)
        else:
            report.unchanged += 1

    def _log_applied(self, target: GuardTarget, scope: Path) -> None:
        policy = target.policy
        if not self._audit:
            log.info("device guard: %s limited to %s (%s)", target.label, policy.describe(), scope)
            return
        try:
            planned = self._rules.planned(scope, policy)
        except VcudaError as err:
            planned = [f"(cannot compute: {err})"]
        log.info("device guard audit: %s would be limited to %s", target.label, policy.describe())
        for line in planned[:20]:
            log.info("device guard audit:   %s", line)
        if len(planned) > 20:
            log.info("device guard audit:   ... %d more", len(planned) - 20)

    def _take_back(self, key: tuple[str, str], report: ReconcileReport) -> None:
        guarded = self._guarded[key]
        try:
            self._rules.remove(guarded.scope)
        except VcudaError as err:
            self._fail(key, f"device guard: removing the rules of {guarded.target.label}: {err}", report)
            return
        del self._guarded[key]
        self._resolved(key, guarded.target.label)
        report.removed.append(guarded.target.label)
        log.info("device guard: %s is no longer a target; its rules are removed", guarded.target.label)

    def _forget(self, key: tuple[str, str]) -> None:
        """The container's cgroup is gone (or moved): drop what we held for it."""
        guarded = self._guarded.pop(key, None)
        if guarded is not None:
            try:
                self._rules.remove(guarded.scope)
            except VcudaError as err:
                log.debug("device guard: cleaning up %s: %s", guarded.target.label, err)

    def _fail(self, key: object, message: str, report: ReconcileReport) -> None:
        self._errors += 1
        report.errors.append(message)
        if self._problems.get(key) != message:
            self._problems[key] = message
            log.warning("%s", message)

    def _resolved(self, key: object, what: str) -> None:
        if self._problems.pop(key, None) is not None:
            log.info("device guard: the problem with %s is resolved", what)

    def stats(self) -> GuardStats:
        with self._lock:
            denied: dict[str, int] = {}
            for guarded in self._guarded.values():
                count = self._rules.denied(guarded.scope)
                if count is not None:
                    denied[guarded.target.label] = count
            return GuardStats(
                mode=self.mode,
                mechanism=self.mechanism,
                guarded=len(self._guarded),
                pending=len(self._pending),
                reattachments=self._reattachments,
                errors=self._errors,
                passes=self._passes,
                denied=denied,
            )

    def close(self, remove_rules: bool = False) -> None:
        """Stop guarding. Rules stay in place unless ``remove_rules`` (the next agent takes over)."""
        with self._lock:
            if remove_rules:
                for key in list(self._guarded):
                    self._take_back(key, ReconcileReport())
            self._rules.close()
