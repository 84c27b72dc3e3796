"""The device gate: device rules on each pod's cgroup from the moment it appears.

The device guard (``deviceguard``) narrows a *container* once the pod's status names it,
about a reconcile interval after it started; a device opened before that stays usable
(an open descriptor outlives later device rules). The gate closes that window one level
up: kubelet creates a pod's cgroup before any of its containers (the sandbox first), so
rules put on the pod's cgroup hold for every container from its first instruction.

It watches the kubepods tree with inotify (kubepods, its QoS parents, each pod) and, when
a pod cgroup appears, puts the pod's policy on it at once: the union of the GPUs the
ledger holds for the pod (Allocate runs at admission, before kubelet creates the cgroup),
no NVIDIA device for a pod without any, nothing for an exempt pod (the same decisions as
the guard's targets). A pod the agent does not know yet gets no NVIDIA device until it is
resolved, and so does every pod gated before the pod cache has synced (from the agent's
first instant: a DaemonSet rollout restarts it while pods start), beyond what the ledger
holds for it; an exempt one among them is released the moment its exemption can be
checked. When a container cgroup appears in a pod the policy is evaluated again (a DRA
claim is prepared after the pod cgroup exists, before its containers), and every
``interval_s`` all pod cgroups are.

Mechanisms: on cgroup v2 the guard's own program, attached to the pod's cgroup (the
kernel runs it for every cgroup below; runtimes only detach programs on the container's
own cgroup). On v1 deny lines on the pod's devices cgroup, without "m" (see
``V1DeviceRules``): children inherit them, and a runtime that later tries to allow a GPU
outside the pod's set is refused by the kernel, so such a container does not start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.control.deviceguard import TargetsNotReadyError
from agent.errors import VcudaError
from agent.platform.cgroups.devicepolicy import DevicePolicy, DeviceRules, Outcome, read_nvidia_majors
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.paths import CgroupResolver, pod_uid_of, qos_dir_names
from agent.platform.inotify import IN_Q_OVERFLOW, TreeWatch
from agent.settings import GuardMode

log = logging.getLogger(__name__)

# pod UID → its policy; None: the pod is exempt. Raises TargetsNotReadyError to wait.
PodVerdict = Callable[[str], DevicePolicy | None]


@dataclass(frozen=True)
class GateStats:
    gated: int  # pod cgroups holding the gate's rules now
    applied: int  # pod cgroups given rules on sight (total)
    errors: int


class PodGate:
    def __init__(
        self,
        verdict: PodVerdict,
        resolver: CgroupResolver,
        rules: DeviceRules,
        *,
        mode: GuardMode = GuardMode.ENFORCE,
        interval_s: float = 2.0,
        proc_root: Path = Path("/proc"),
        settled: Callable[[], bool] | None = None,
    ) -> None:
        """``settled``: whether ``verdict`` can tell exempt pods yet (before, it fails closed:
        the pods gated meanwhile are judged again the moment it can)."""
        self._verdict = verdict
        self._settled = settled
        self._provisional: set[Path] = set()  # gated before the verdict could tell exemptions
        self._resolver = resolver
        self._rules = rules
        self.mode = GuardMode(mode)
        self.interval_s = interval_s
        self._proc_root = proc_root
        self._root = resolver.kubepods_root(rules.controller)
        self._qos = {self._root / name for name in qos_dir_names(resolver.driver)}
        self._gated: dict[Path, DevicePolicy] = {}
        self._applied = 0
        self._errors = 0
        self._problems: dict[Path, str] = {}
        self._lock = threading.Lock()
        self.watching = threading.Event()  # set once the kubepods tree is watched

    def run(self, stop: threading.Event) -> None:
        """Watch kubepods until ``stop`` (a Supervisor task); re-check every pod each interval."""
        if self.mode == GuardMode.OFF:
            return
        watch = TreeWatch()
        try:
            while not stop.is_set():
                if not watch.watching(self._root) and not self._watch_tree(watch):
                    stop.wait(self.interval_s)  # no kubepods yet (kubelet not started)
                    continue
                self.reconcile_once(watch)
                self.watching.set()
                deadline = time.monotonic() + self.interval_s
                while time.monotonic() < deadline and not stop.is_set():
                    events = watch.read(min(0.5, deadline - time.monotonic()))
                    if any(e.event.watch_gone and e.directory == self._root for e in events):
                        watch.close()
                        watch = TreeWatch()  # kubepods went away: start over
                        self.watching.clear()
                        break
                    for item in events:
                        if item.event.created:
                            self._created(watch, item.directory / item.event.name)
                    self._judge_provisional()
                    if any(e.event.mask & IN_Q_OVERFLOW for e in events):
                        break  # events were lost: a full pass now
        finally:
            watch.close()

    def _judge_provisional(self) -> None:
        """The pods gated before exemptions could be told, judged again once they can."""
        if not self._provisional or self._settled is None or not self._settled():
            return
        with self._lock:
            pending, self._provisional = self._provisional, set()
        for pod_dir in pending:
            if pod_dir.is_dir():
                self.gate(pod_dir)

    def _watch_tree(self, watch: TreeWatch) -> bool:
        if not watch.add(self._root):
            return False
        for qos in self._qos:
            watch.add(qos)
        return True

    def _created(self, watch: TreeWatch, path: Path) -> None:
        if path in self._qos:
            watch.add(path)
            for child in _subdirs(path):  # pods made before the watch was in place
                self._created(watch, child)
        elif self._is_pod_dir(path):
            self.gate(path)  # first: the rules, then the watch for its containers
            watch.add(path)
        elif self._is_pod_dir(path.parent):
            self.gate(path.parent)  # a container is being created: the pod's set may have grown

    def _is_pod_dir(self, path: Path) -> bool:
        return (path.parent in self._qos or path.parent == self._root) and pod_uid_of(path.name) is not None

    def reconcile_once(self, watch: TreeWatch | None = None) -> None:
        """Every pod cgroup gets its current policy; vanished ones are forgotten."""
        try:
            self._rules.set_majors(read_nvidia_majors(self._proc_root))
        except VcudaError as err:
            if self._problems.get(self._proc_root) != str(err):
                self._problems[self._proc_root] = str(err)
                log.warning("device gate: %s", err)
        pods = [p for parent in (self._root, *self._qos) for p in _subdirs(parent) if pod_uid_of(p.name)]
        for pod_dir in pods:
            self.gate(pod_dir)
            if watch is not None and not watch.watching(pod_dir):
                watch.add(pod_dir)
        with self._lock:
            for gone in [p for p in self._gated if not p.is_dir()]:
                del self._gated[gone]
                self._problems.pop(gone, None)
                try:
                    self._rules.remove(gone)  # drops what the mechanism holds for it
                except VcudaError as err:
                    log.debug("device gate: forgetting %s: %s", gone, err)

    def gate(self, pod_dir: Path) -> Outcome | None:
        """Put the pod's policy on ``pod_dir`` now; None when it is exempt or not decidable yet."""
        uid = pod_uid_of(pod_dir.name)
        if uid is None or not pod_dir.is_relative_to(self._root):
            return None
        with self._lock:
            try:
                if self._settled is not None and not self._settled():
                    self._provisional.add(pod_dir)
                policy = self._verdict(uid)
            except TargetsNotReadyError:
                return None
            try:
                if policy is None:
                    if pod_dir in self._gated:
                        del self._gated[pod_dir]
                        self._rules.remove(pod_dir)
                        log.info("device gate: pod %s is exempt; its pod-level rules are removed", uid)
                    return None
                outcome = self._rules.ensure(pod_dir, policy, self.mode == GuardMode.AUDIT)
            except (VcudaError, ValueError) as err:
                if not pod_dir.is_dir():
                    return None  # the pod went while we looked
                self._errors += 1
                if self._problems.get(pod_dir) != str(err):
                    self._problems[pod_dir] = str(err)
                    log.warning("device gate: pod %s: %s", uid, err)
                return None
            self._problems.pop(pod_dir, None)
            if self._gated.get(pod_dir) != policy:
                if pod_dir not in self._gated:
                    self._applied += 1
                log.info("device gate: pod %s limited to %s (%s)", uid, policy.describe(), pod_dir)
            self._gated[pod_dir] = policy
            return outcome

    def stats(self) -> GateStats:
        with self._lock:
            return GateStats(gated=len(self._gated), applied=self._applied, errors=self._errors)


def gate_rules(guard_rules: DeviceRules) -> DeviceRules:
    """The gate's mechanism beside the guard's: the same v2 program (one compile, one map),
    or v1 deny lines that keep "m" (see ``V1DeviceRules``)."""
    if isinstance(guard_rules, V1DeviceRules):
        return V1DeviceRules(deny_access="rw")
    return guard_rules


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:  # gone, or not there yet
        return []
