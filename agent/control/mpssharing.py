"""MPS sharing on the node: which GPUs share through an MPS control daemon, the daemons'
supervision, and each share's MPS limits, handed out at Allocate.

**Only limits a tenant cannot lift are used unless the node says otherwise.** On every
driver so far (580 measured; docs/reference.md, "The MPS control daemon") a client's MPS
limits are advisory: the client's own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is what the
daemon applies below its default of 100 (a container's env, or the process itself, sets
it), and the daemon-side settings that would bind it are changed by anyone who reaches
the control socket, which every client must reach. So by default (``advisory_limits`` off) a GPU in ``mps`` or
``auto`` mode gets no daemon and its shares are held by the freezer, with that reason in
status. With ``--mps-advisory-limits`` (node config ``mpsAdvisoryLimits: true``; for
trusted tenants) a GPU's daemon is started at the first Allocate of a share on it, kept
running (restarted when it dies) while the GPU holds shares, and stopped after
``idle_stop_s`` without any. A share then gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for
its ceiling (fixed-share: its cap; burst-share: its limit, 100 without one; best-effort:
100), never more than what the GPU's fixed shares leave (100 - the others' fixed caps, for
best-effort and burst-share), rounded to whole TPCs as the hardware does
(:mod:`agent.platform.gpu.mpspartition`), and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for its
vcuda-memory; every such grant is marked advisory in status and metrics. Whole GPUs never
get a daemon. Whatever cannot have MPS (the command is missing, the daemon will not come
up) is held by the freezer as before, and the reason is kept for status.

**MPS v3** (``capability.v3``: the node's control daemon speaks protocol 3, r615+/R620;
:mod:`agent.platform.mpsv3`): the limits are the daemon's, not the client's. Each share gets a
namespace with its percentage and memory limit, bound to its pod's and then its container's
cgroup (:mod:`.mpsnamespacing`); the daemon runs with ``-p 3``, the ADVISORY reason does not
apply, and the grants are enforceable, marked unverified on hardware, for the shares
:mod:`.mpstrust` trusts (none of their processes runs as the daemon's uid); the freezer
holds the others. A share without a ledger container (a DRA claim's) gets no namespace:
advisory as before. Without v3 nothing changes.

**Threads.** What the control loop asks every period (:meth:`MpsSharing.concurrent`,
:meth:`MpsSharing.blind_share`) is read from the last published view (:mod:`.mpsview`), no
lock. Daemon work and v3 commands run in the Allocate's thread or the "mps" supervision
thread, under that GPU's lock alone (:mod:`.mpsdaemons`); the records change under a state
lock held for in-memory updates only, each change publishing a new view.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.control.mpsdaemons import DaemonPool
from agent.control.mpsgrants import MpsGrant, load_grants, mps_ceiling, save_grants
from agent.control.mpsnamespacing import NamespaceBinder
from agent.control.mpstrust import NamespaceTrust, SpecRefusals, mixed_users, read_uids
from agent.control.mpsview import GpuSharing, SharingView, build_view, gpu_sharing
from agent.domain.ledger import Assignment
from agent.domain.requests import ResolvedRequest
from agent.domain.specs import EnforcementSpec
from agent.errors import PlatformError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.mpspartition import partition_for, sm_count_for, throughput_curve_for
from agent.platform.mpsdaemon import DaemonState, DaemonStatus, probe_command
from agent.platform.mpsv3 import MpsCapability, Runner, namespace_name
from agent.settings import SharingMode, SharingSettings

__all__ = ["ADVISORY", "TICK_S", "GpuSharing", "MpsSharing"]

log = logging.getLogger(__name__)

TICK_S = 1.0
# Why an MPS limit is advisory on every driver so far (None once a driver has limits bound
# to the client's cgroup that the client cannot change: MPS v3 namespaces, R620+, untested).
ADVISORY = (
    "a client's MPS limits are advisory on this driver: its own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
    "is what applies below the daemon's 100 %, and the daemon's settings are changed through the "
    "control socket every client must reach"
)


class MpsSharing:
    def __init__(
        self,
        settings: SharingSettings,
        *,
        gpus: Sequence[GpuInfo],
        command: Sequence[str],
        mode: Callable[[], SharingMode],
        spec_for: Callable[[Assignment], EnforcementSpec | None] = lambda _a: None,
        shares_on: Callable[[int], int] | None = None,
        fixed_on: Callable[[int, Assignment | None], int] = lambda _gpu, _a: 0,
        live: Callable[[], frozenset[tuple[str, str]]] | None = None,
        advisory_allowed: Callable[[], bool] | None = None,
        advisory_reason: str | None = ADVISORY,
        capability: MpsCapability | None = None,
        root_risk: Callable[[Assignment], str | None] | None = None,
        clock: Clock | None = None,
        run_command: Runner | None = None,
    ) -> None:
        """``fixed_on(gpu, assignment)``: the fixed-share caps on ``gpu`` of shares other than
        ``assignment``'s; ``advisory_allowed``: whether limits a tenant can lift may be used
        now (default: the settings'); ``advisory_reason``: why this driver's MPS limits are
        advisory (None: they are not); ``capability``: what the node's driver offers (MPS v3
        makes the limits the daemon's: not advisory); ``root_risk``: why a container's pod spec
        does not prove it cannot run as root (None: proven; MPS v3 gives such a share no grant;
        no callable: no pod model, the uid readings alone decide); ``run_command``: what runs
        the v3 control commands (None: subprocess.run; tests pass a stand-in)."""
        self.settings = settings
        self._mode = mode
        self._spec_for = spec_for
        self._fixed_on = fixed_on
        self._advisory_allowed = advisory_allowed or (lambda: settings.advisory_limits)
        self.capability = capability
        v3 = capability is not None and capability.v3
        self.advisory_reason = None if v3 else advisory_reason
        self._root_risk = root_risk
        self._live = live  # (pod uid, container) of every ledger entry: grants of others go
        self._clock = clock or SystemClock()
        self.command = list(command)
        self.unavailable = probe_command(self.command)  # why MPS cannot run here; None: it can
        self._pool = DaemonPool(
            gpus,
            [*self.command, "-p", "3"] if v3 else self.command,
            settings.mps_root,
            idle_stop_s=settings.idle_stop_s,
            shares_on=shares_on,
            report=self._report,
        )
        self._daemons = self._pool.daemons
        self._binder = NamespaceBinder(self.command, run=run_command) if v3 else None
        self.trust = NamespaceTrust(os.geteuid()) if v3 else None  # the daemon runs as the agent
        # The records below change under _state only, which is never held across a daemon
        # call, a command or a file; each change publishes a new view (module docstring).
        self._state = threading.Lock()
        self._saving = threading.Lock()  # one write of grants.json at a time, the latest last
        self._refused = SpecRefusals()  # MPS v3: shares given no grant by their pod spec
        self._grants_file = settings.mps_root / "grants.json"
        self._grants, problem = load_grants(self._grants_file)
        if problem is not None:
            log.warning("ignoring unreadable MPS grants in %s: %s", self._grants_file, problem)
        self._view = build_view(self._grants, self.trust, {})
        self._reported: set[str] = set()
        # Set by the node once it can list a container's processes: (pod uid, container) -> the
        # user ids its processes run as; and who hears of a GPU whose clients' uids differ.
        self.users_of: Callable[[str, str], frozenset[int]] | None = None
        self.uids_of: Callable[[str, str], frozenset[int]] | None = None  # every uid field (v3 trust)
        self.on_mixed_users: Callable[[int, list[str], list[int]], None] | None = None
        self.mixed_users: dict[int, list[int]] = {}  # GPU -> the user ids of its MPS clients
        # Set by the node (MPS v3): (pod uid, container) -> its cgroup directory (None: not yet).
        self.cgroup_of: Callable[[str, str], Path | None] | None = None

    @property
    def view(self) -> SharingView:
        """The latest published view (never changes; a later change publishes another)."""
        return self._view

    def _publish(self) -> None:
        """Replace the view with one of the records now (the caller holds ``_state``)."""
        self._view = build_view(self._grants, self.trust, self._refused.snapshot())

    # Allocate -------------------------------------------------------------------------------
    def mode(self) -> SharingMode:
        return self._mode()

    def grant_for(self, item: ResolvedRequest, assignment: Assignment | None) -> MpsGrant | None:
        """The MPS limits for one container of an Allocate; None: not an MPS client (whole
        GPUs, freezer mode, MPS unavailable: the freezer holds it)."""
        if item.whole or self.mode() is SharingMode.FREEZER:
            return None
        ceiling, memory = item.cores, None
        spec = self._spec_for(assignment) if assignment is not None else None
        if spec is not None:
            ceiling, memory = (
                mps_ceiling(spec, self._fixed_on(item.gpus[0].index, assignment)),
                spec.memory_quota_mib,
            )
        key = None if assignment is None else _key(assignment.pod_uid, assignment.container)
        if self._binder is not None and assignment is not None and key is not None and self._root_risk:
            risk, gpu = self._root_risk(assignment), item.gpus[0].index
            with self._state:
                serving = sorted(k for k, g in self._grants.items() if g.gpu == gpu and k != key)
                why = self._refused.decide(key, gpu, risk, serving)
                self._publish()
            if why is not None:  # no pipe mount: it cannot reach the control socket at all
                level = logging.WARNING if serving else logging.INFO
                log.log(level, "MPS v3: %s gets no MPS grant: %s", key, why)
                return None
        grant = self._grant(item.gpus[0], ceiling, memory, key)
        if grant is not None and key is not None:
            with self._state:
                self._grants[key] = grant
                self._publish()
            self._save()
        return grant

    def grant_share(self, gpu: GpuInfo, ceiling: int, memory_mib: int | None) -> MpsGrant | None:
        """The MPS limits for a share that is not a device-plugin container (a DRA claim's:
        its CDI spec carries them); None where the freezer holds it. Not recorded in
        grants.json, whose entries are per ledger container."""
        if self.mode() is SharingMode.FREEZER:
            return None
        return self._grant(gpu, ceiling, memory_mib, None)

    def _grant(self, gpu: GpuInfo, ceiling: int, memory_mib: int | None, key: str | None) -> MpsGrant | None:
        reason = self.why_not(gpu.index)
        if reason is None and self._binder is not None and key is None and not self._advisory_allowed():
            # no ledger container to make a namespace for: its limits would be the env's alone
            reason = "no MPS v3 namespace for a share without a ledger container (a DRA claim's)"
        if reason is not None:
            self._report(f"GPU {gpu.index}: no MPS ({reason}); its shares are held by the freezer")
            return None
        daemon = self._daemons[gpu.index]
        partition = partition_for(ceiling, sm_count_for(gpu.model), throughput_curve_for(gpu.model))
        cgroup = self._cgroup(key) if self._binder is not None and key is not None else None
        why = None
        with self._pool.lock(gpu.index):  # this GPU's daemon work only: never the control loop's
            self._pool.in_use(gpu.index)
            try:
                ready = daemon.wait_ready(self.settings.ready_timeout_s)
            except PlatformError as err:
                self._report(f"GPU {gpu.index}: no MPS ({err}); its shares are held by the freezer")
                return None
            if ready and self._binder is not None and key is not None:
                why = self._binder.prepare(daemon.pipe_dir, daemon.status().pid) or self._binder.create(
                    key, daemon.pipe_dir, partition.percent, memory_mib, cgroup
                )
        if not ready:
            log.warning(
                "GPU %d: the MPS control daemon is not up (%s); this share is held by the freezer",
                gpu.index,
                daemon.error or daemon.state,
            )
            return None
        if why is not None:
            log.error(
                "GPU %d: MPS v3 namespace refused (%s); this share is held by the freezer", gpu.index, why
            )
            return None
        namespace = None if self._binder is None or key is None else namespace_name(*key.split("/", 1))
        return MpsGrant(
            gpu.index,
            partition,
            memory_mib,
            daemon.pipe_dir,
            daemon.log_dir,
            advisory=self.advisory_reason is not None or (self._binder is not None and namespace is None),
            namespace=namespace,
        )

    def _cgroup(self, key: str) -> Path | None:
        pod_uid, _, container = key.partition("/")
        return None if self.cgroup_of is None else self.cgroup_of(pod_uid, container)

    def bind_pending(self) -> None:
        """MPS v3: bind each share's namespace to its container's cgroup once that is known."""
        if self._binder is None or self.cgroup_of is None:
            return
        for key, grant in self._view.grants.items():
            cgroup = self._cgroup(key) if grant.namespace is not None else None
            if cgroup is None or self._binder.bound(key) == cgroup:
                continue
            with self._pool.lock(grant.gpu):
                why = self._binder.bind(key, grant.pipe_dir, cgroup)
            if why is not None:
                self._report(f"GPU {grant.gpu}: MPS v3 namespace of {key} not bound to {cgroup}: {why}")

    def why_not(self, gpu: int) -> str | None:
        """Why this GPU's shares cannot use MPS now (None: they can)."""
        if self.mode() is SharingMode.FREEZER:
            return "sharing mode is freezer"
        if self.unavailable is not None:
            return self.unavailable
        daemon = self._daemons[gpu]
        if daemon.state is DaemonState.FAILED:
            return daemon.error
        # A daemon that already runs keeps its clients' grants (stopping it would end them):
        # a change to advisory_limits applies once it stopped, idle.
        if (
            self.advisory_reason is not None
            and not self._advisory_allowed()
            and daemon.state is DaemonState.STOPPED
        ):
            return (
                f"{self.advisory_reason}; so the freezer holds this GPU's shares "
                "(mpsAdvisoryLimits: true uses MPS limits anyway, for trusted tenants only)"
            )
        return None

    def advisory(self, gpu: int) -> bool:
        """Whether the MPS limits in use on this GPU are advisory (a tenant can lift them)."""
        return self.advisory_reason is not None and self.why_not(gpu) is None

    # Supervision (the "mps" thread) ---------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.resume()
        while not self._clock.sleep(TICK_S, stop):
            self.tick()

    def resume(self) -> None:
        """At start: adopt the daemons a previous agent left running; the next ticks restart
        any that died meanwhile on GPUs that still hold shares, or stop those that hold none."""
        wanted = self.mode() is not SharingMode.FREEZER and self.unavailable is None
        self._pool.resume(self._clock.monotonic(), start_missing=wanted)

    def tick(self) -> None:
        """Restart dead daemons; stop those whose GPU has held no share for idle_stop_s."""
        self._pool.tick(self._clock.monotonic())
        if self._live is not None:
            self.forget(set(self._live()))
        self.bind_pending()
        self.check_users()

    def check_users(self) -> None:
        """A GPU whose clients run as more than one uid is reported (status, log, Event:
        :func:`.mpstrust.mixed_users`); MPS v3: which shares are trusted to their namespaces."""
        grants = list(self._view.grants.items())
        self._check_trust(grants)
        if self.users_of is None:
            return
        mixed = mixed_users(grants, self.users_of)
        for gpu, (keys, uids) in mixed.items():
            if self.mixed_users.get(gpu) != uids and self.on_mixed_users is not None:
                self.on_mixed_users(gpu, keys, uids)
        self.mixed_users = {gpu: uids for gpu, (_keys, uids) in mixed.items()}

    def _check_trust(self, grants: list[tuple[str, MpsGrant]]) -> None:
        """A share that loses trust is held by the freezer from the next period on (the new
        view says so), then gets 100 % in its namespace: the freezer alone holds it now, to
        its grant (an honest one would get grant x grant under both)."""
        if self.trust is None or self._binder is None:
            return
        readings = read_uids(grants, self.uids_of)
        with self._state:
            moved = self.trust.update(readings)
            self._publish()
        for m in moved:
            grant = self._view.grants.get(m.key)
            if grant is None:
                continue
            with self._pool.lock(grant.gpu):
                why = self._binder.open_up(m.key, grant.pipe_dir)
            if why is not None:
                log.info("MPS v3: namespace of %s not opened to 100 %%: %s", m.key, why)

    def untrusted(self, pod_uid: str, container: str) -> str | None:
        """Why an MPS v3 share is not trusted to its namespace, so the freezer holds it (None:
        trusted, or no namespace: its grant says what holds it)."""
        return self._view.untrusted.get(_key(pod_uid, container))

    def refused(self, pod_uid: str, container: str) -> str | None:
        """Why an MPS v3 share got no grant from its pod spec (None: it was not refused)."""
        return self._view.refused.get(_key(pod_uid, container))

    def blind_share(self, pod_uid: str, container: str) -> float | None:
        """The share of the GPU the freezer holds an untrusted v3 share to (None: trusted).
        The control loop's: it reads the published view, no lock."""
        return self._view.blind.get(_key(pod_uid, container))

    def forget(self, keep: set[tuple[str, str]]) -> None:
        """Drop the grants of containers no longer in the ledger (and their namespaces)."""
        with self._state:
            self._refused.keep(lambda k: tuple(k.split("/", 1)) in keep)
            stale = {k: g for k, g in self._grants.items() if tuple(k.split("/", 1)) not in keep}
            for k in stale:
                del self._grants[k]
            self._publish()
        for k, grant in stale.items():
            if self._binder is not None and grant.namespace is not None:
                with self._pool.lock(grant.gpu):
                    self._binder.delete(k, grant.pipe_dir)
        if stale:
            self._save()

    # Status ---------------------------------------------------------------------------------
    def concurrent(self, gpu: int) -> bool:
        """Whether shares of this GPU run as MPS clients (concurrently, not time-sliced). The
        control loop's: it reads the published view, no lock."""
        return gpu in self._view.concurrent

    def grant(self, pod_uid: str, container: str) -> MpsGrant | None:
        return self._view.grants.get(_key(pod_uid, container))

    def gpus(self) -> list[GpuSharing]:
        """Each GPU's actuator and why; the driver's MPS capability where it was probed."""
        view, v3, capability = self._view, self._binder is not None, self.capability
        held = [
            gpu_sharing(index, daemon, self.why_not(index), self.mixed_users.get(index), view, v3=v3)
            for index, daemon in sorted(self._daemons.items())
        ]
        if capability is None:
            return held
        return [replace(g, reason=f"{g.reason}; {capability.describe_gpu(g.gpu)}") for g in held]

    def daemon_statuses(self) -> list[DaemonStatus]:
        return self._pool.statuses()

    # Persistence ----------------------------------------------------------------------------
    def _save(self) -> None:
        with self._saving:  # the view read here is at least as new as any saver's before
            problem = save_grants(self._grants_file, dict(self._view.grants))
        if problem is not None:
            self._report(f"cannot record MPS grants in {self._grants_file}: {problem}")

    def _report(self, message: str) -> None:
        if message not in self._reported:
            self._reported.add(message)
            # auto falls back by design; mps was asked for and did not happen
            log.log(logging.INFO if self.mode() is SharingMode.AUTO else logging.ERROR, "%s", message)


def _key(pod_uid: str, container: str) -> str:
    return f"{pod_uid}/{container}"
