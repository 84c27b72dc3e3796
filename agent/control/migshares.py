"""Hardware-isolated shares on demand: a MIG instance made at Allocate for one share, destroyed
when its pod is gone, re-adopted after an agent restart.

The node config's ``mig.onDemand`` names the GPUs that serve them (``domain/migconfig.py``).
Such a GPU is put in MIG mode when it has no processes, as a geometry is (the mode may then
wait for a GPU reset: the agent never resets a GPU); until it is in MIG mode it offers no
shares, with why. In MIG mode it offers its vcuda-core and vcuda-memory for isolated shares
only (``surfaces/deviceplugin/isolated.py`` serves them): each gets the smallest MIG profile
covering its cores and memory that still fits beside the GPU's instances
(``domain/migfit.py``), created at the placement that leaves the most room.

Which instance serves which share (pod UID, container, GPU, GI/CI ids, UUID) is checkpointed
in ``--state-dir`` (``migsharebook.py``) after every change. At start the checkpoint is read
and each share whose instance still exists is adopted; instances on an on-demand GPU that no
share names (the agent stopped between creating one and writing the checkpoint) are
destroyed, unless the checkpoint could not be read. Every ``MIG_SHARES_RECONCILE_S`` the
instances of pods that are gone or finished are destroyed (tried again while the driver
refuses, e.g. a process still on the instance), and on-demand GPUs not yet in MIG mode are
put there. Nothing here raises out of a pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agent.clock import Clock, SystemClock
from agent.control.migholdings import MigGrant
from agent.control.migmode import pending_reset, pids_on
from agent.control.migsharebook import IsolatedShare, ShareKey, load_shares, save_shares
from agent.control.migwatch import MigWatch
from agent.domain.migconfig import MigConfig
from agent.domain.migfit import smallest_fit, why_not
from agent.errors import AllocationError, GpuError, InsufficientCapacityError, PlatformError
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.gpu.migprofiles import (
    GpuInstanceProfile,
    MigProduct,
    Placement,
    full_ci_profile,
    product_for,
)
from agent.platform.gpu.migstate import MigDevice, MigInfo
from agent.platform.kube.podcache import PodCache
from agent.settings import MIG_SHARES_RECONCILE_S

log = logging.getLogger(__name__)


class MigShares:
    """The isolated shares of the node's on-demand GPUs (see the module docstring)."""

    def __init__(
        self,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        watch: MigWatch,
        config: Callable[[], MigConfig],
        checkpoint: Path | None,
        *,
        reconcile_s: float = MIG_SHARES_RECONCILE_S,
        clock: Clock | None = None,
    ) -> None:
        """``checkpoint``: the file the shares are kept in (None: not kept, as without a state dir)."""
        self._backend = backend
        self._gpus = {g.index: g for g in gpus}
        self._watch = watch
        self._config = config
        self._checkpoint = checkpoint
        self._reconcile_s = reconcile_s
        self._clock = clock or SystemClock()
        self._lock = threading.RLock()  # create, destroy and the checkpoint are one step
        self._shares: dict[ShareKey, IsolatedShare] = {}
        self._not_ready: dict[int, str] = {}  # on-demand GPU -> why it serves no share yet
        self._told: dict[object, str] = {}  # what was logged last per subject (logged once)
        self.pods: PodCache | None = None  # with Kubernetes: whose pods are gone
        self.created = self.destroyed = 0

    # What the rest of the agent asks ------------------------------------------------------
    def on_demand(self) -> frozenset[int]:
        """The on-demand GPUs of this node (as configured; the node's own GPUs only)."""
        return frozenset(i for i in self._config().on_demand if i in self._gpus)

    def ready(self) -> frozenset[int]:
        """The on-demand GPUs in MIG mode: they serve isolated shares now."""
        _, infos = self._watch.snapshot()
        return frozenset(i for i in self.on_demand() if (info := infos.get(i)) is not None and info.current)

    def withheld(self, base: Mapping[int, str]) -> dict[int, str]:
        """``base`` (GPU -> why it offers no shares: MIG mode) corrected for on-demand GPUs: one
        in MIG mode offers its shares (isolated ones only), one that is not yet offers none."""
        ready = self.ready()
        out = {i: why for i, why in base.items() if i not in ready}
        for index in self.on_demand() - ready:
            out[index] = self._not_ready.get(index) or (
                f"on demand for hardware-isolated shares: GPU {index} is not in MIG mode yet"
            )
        return out

    def shares(self) -> list[IsolatedShare]:
        with self._lock:
            return sorted(self._shares.values(), key=lambda s: (s.gpu, s.gi))

    def grants(self) -> dict[tuple[str, str], MigGrant]:
        """(pod UID, container) -> the device nodes its instance needs, for the device guard."""
        with self._lock:
            shares = list(self._shares.values())
        grants: dict[tuple[str, str], MigGrant] = {}
        for s in shares:
            minor = self._gpus[s.gpu].minor if s.gpu in self._gpus else None
            gpus = frozenset() if minor is None else frozenset({minor})
            caps = frozenset(m for m in (s.gi_cap_minor, s.ci_cap_minor) if m is not None)
            before = grants.get((s.pod_uid, s.container))
            if before is not None:
                gpus, caps = gpus | before.gpu_minors, caps | before.cap_minors
            grants[(s.pod_uid, s.container)] = MigGrant(gpus, caps)
        return grants

    # Allocate ------------------------------------------------------------------------------
    def create(self, gpu: GpuInfo, key: ShareKey, cores: int, memory_mib: int) -> MigDevice:
        """The MIG device serving the share ``key`` on ``gpu``, made now (or the one it has
        already: kubelet may ask again for the same container). InsufficientCapacityError
        with migfit's reason when no covering profile fits; AllocationError when the GPU is
        not ready or the driver refuses."""
        with self._lock:
            held = self._shares.get(key)
            if held is not None:
                device = self._find(held.gpu, held.gi, held.ci, held.uuid)
                if device is not None and held.gpu == gpu.index:
                    return device
                if device is None:
                    self._drop(held, "its instance is gone")
                elif not self._destroy(held, f"the container is given GPU {gpu.index} now"):
                    raise AllocationError(f"GPU {held.gpu}: its MIG instance {held.uuid} cannot go yet")
            device = self._create(gpu, key, cores, memory_mib)
        self._watch.refresh()
        return device

    def _create(self, gpu: GpuInfo, key: ShareKey, cores: int, memory_mib: int) -> MigDevice:
        index = gpu.index
        product = product_for(gpu.model, gpu.memory_mib)
        if product is None:
            raise AllocationError(f"GPU {index} ({gpu.model}) has no MIG: it cannot serve isolated shares")
        try:
            info = self._backend.mig(index)
        except GpuError as err:
            raise AllocationError(f"GPU {index}: cannot read its MIG state: {err}") from err
        if not info.current:
            why = self._not_ready.get(index) or f"GPU {index} is not in MIG mode yet"
            raise AllocationError(f"GPU {index} cannot make a MIG instance for the share now: {why}")
        fit = smallest_fit(product, cores, memory_mib, instances(product, info))
        if fit is None:
            raise InsufficientCapacityError(f"GPU {index}: {why_not(product, cores, memory_mib)}")
        try:
            gi, ci = self._backend.mig_control().create(
                index, fit.profile, fit.placement, full_ci_profile(fit.profile, product)
            )
        except GpuError as err:
            raise AllocationError(f"cannot make the MIG instance for the share: {err}") from err
        device = self._find(index, gi, ci)
        if device is None:
            raise AllocationError(f"GPU {index}: the new MIG instance (GPU instance {gi}) is not listed")
        share = IsolatedShare.of(key, device, cores, memory_mib)
        self._shares[key] = share
        self.created += 1
        self._save()
        log.info(
            "isolated share of %s/%s container %s: %s %s on GPU %d (GPU instance %d at %s)",
            key.namespace, key.pod, key.container, device.profile, device.uuid, index, gi, fit.placement,
        )  # fmt: skip
        return device

    def release(self, key: ShareKey) -> bool:
        """Destroy the share's instance (an Allocate that failed as a whole); True when gone."""
        with self._lock:
            share = self._shares.get(key)
            done = share is None or self._destroy(share, "its Allocate failed")
        if share is not None:
            self._watch.refresh()
        return done

    # Start, and every pass -------------------------------------------------------------------
    def adopt(self) -> None:
        """At start: the checkpoint's shares whose instance still exists, and no orphan."""
        loaded, readable = load_shares(self._checkpoint) if self._checkpoint is not None else ([], True)
        on_demand = self.on_demand()
        with self._lock:
            for share in loaded:
                if share.gpu in on_demand and self._find(share.gpu, share.gi, share.ci, share.uuid):
                    self._shares[share.key] = share
                    log.info("isolated share of %s: adopted %s %s", share.label, share.profile, share.uuid)
                else:
                    log.info(
                        "isolated share of %s: %s is gone (or its GPU is no longer on demand)",
                        share.label,
                        share.uuid,
                    )
            if readable:
                self._destroy_orphans(on_demand)
            self._save()
        self._watch.refresh()

    def reconcile_once(self) -> None:
        """Put on-demand GPUs in MIG mode; destroy the instances of pods that are gone."""
        changed = any([self._prepare(i) for i in sorted(self.on_demand())])
        pods = self.pods
        if pods is not None and pods.stats().synced:  # a pod it does not know is then gone
            with self._lock:
                for share in list(self._shares.values()):
                    pod = pods.get(share.pod_uid)
                    if pod is None or pod.finished:
                        why = "its pod is gone" if pod is None else "its pod finished"
                        changed |= self._destroy(share, why)
        if changed:
            self._watch.refresh()

    def run(self, stop: threading.Event) -> None:
        while not self._clock.sleep(self._reconcile_s, stop):
            self.reconcile_once()

    # Internals -------------------------------------------------------------------------------
    def _prepare(self, index: int) -> bool:
        """MIG mode on an on-demand GPU that is idle; True when the GPU was changed."""
        try:
            info = self._backend.mig(index)
            if info.current:
                self._not_ready.pop(index, None)
                return False
            if not info.capable:
                return self._wait(index, f"GPU {index} has no MIG: it cannot serve isolated shares")
            if info.pending:
                return self._wait(index, _pending(index))
            pids = pids_on(self._backend, index)
            if pids:
                return self._wait(index, f"GPU {index} has processes ({pids}): MIG mode waits for none")
            pending = self._backend.mig_control().set_mode(index, True)
        except GpuError as err:
            return self._wait(index, f"GPU {index}: cannot enable MIG mode: {err}")
        log.info("GPU %d: MIG mode enabled for isolated shares on demand%s", index,
                 " (pending a GPU reset)" if pending else "")  # fmt: skip
        if pending:
            self._wait(index, _pending(index))
        else:
            self._not_ready.pop(index, None)
        return True

    def _wait(self, index: int, why: str) -> bool:
        self._not_ready[index] = why
        self._tell(("gpu", index), f"GPU {index} serves no isolated share yet: {why}", logging.WARNING)
        return False

    def _destroy(self, share: IsolatedShare, why: str) -> bool:
        try:
            self._backend.mig_control().destroy(share.gpu, share.gi, [share.ci])
        except GpuError as err:
            if self._find(share.gpu, share.gi, share.ci, share.uuid) is not None:
                self._tell(share.key, f"isolated share of {share.label}: {why}, but {err}; tried again",
                           logging.WARNING)  # fmt: skip
                return False
        self._drop(share, why, "destroyed")
        self.destroyed += 1
        return True

    def _drop(self, share: IsolatedShare, why: str, done: str = "forgotten") -> None:
        self._shares.pop(share.key, None)
        self._told.pop(share.key, None)
        log.info("isolated share of %s: %s; %s %s %s", share.label, why, share.profile, share.uuid, done)
        self._save()

    def _destroy_orphans(self, on_demand: frozenset[int]) -> None:
        named = {(s.gpu, s.gi) for s in self._shares.values()}
        for index in sorted(on_demand):
            try:
                info = self._backend.mig(index)
            except GpuError as err:
                log.warning("GPU %d: cannot read its MIG instances: %s", index, err)
                continue
            orphans: dict[int, list[int]] = {}
            for d in info.devices:
                if (index, d.gi) not in named:
                    orphans.setdefault(d.gi, []).append(d.ci)
            for gi, cis in sorted(orphans.items()):
                try:
                    self._backend.mig_control().destroy(index, gi, cis)
                    log.info("GPU %d: destroyed GPU instance %d, which no isolated share holds", index, gi)
                except GpuError as err:
                    log.warning("GPU %d: GPU instance %d holds no isolated share: %s", index, gi, err)

    def _find(self, index: int, gi: int, ci: int, uuid: str | None = None) -> MigDevice | None:
        try:
            devices = self._backend.mig(index).devices
        except GpuError:
            return None
        return next((d for d in devices if (d.gi, d.ci) == (gi, ci) and uuid in (None, d.uuid)), None)

    def _save(self) -> None:
        if self._checkpoint is None:
            return
        try:
            save_shares(self._checkpoint, list(self._shares.values()))
        except PlatformError as err:
            log.error("cannot write the isolated shares' checkpoint %s: %s", self._checkpoint, err)

    def _tell(self, subject: object, message: str, level: int) -> None:
        if self._told.get(subject) != message:
            self._told[subject] = message
            log.log(level, "%s", message)


def instances(gpu: MigProduct, info: MigInfo) -> list[tuple[GpuInstanceProfile, Placement]]:
    """The GPU instances of ``info`` (one per GI, whatever its compute instances), as migfit
    takes them; a profile the tables lack is left out (it cannot be planned around)."""
    seen: dict[int, tuple[GpuInstanceProfile, Placement]] = {}
    for d in info.devices:
        profile = gpu.by_name(d.gi_profile)
        if profile is not None and d.gi not in seen:
            seen[d.gi] = (profile, Placement(d.placement_start, d.placement_size))
    return list(seen.values())


def _pending(index: int) -> str:
    return pending_reset(index, "it serves isolated shares after it")
