"""Dynamic MIG for the DRA driver: the MIG instances of the GPUs the node config gives to it
(``mig.dynamic``), created when kubelet prepares a claim and destroyed when it unprepares it.

- ``ready()``: the dynamic GPUs whose partitionable devices may be published: MIG-capable,
  MIG mode on and no mode change pending (the publisher looks at it).
- ``create(index, profile, placement)``: a GPU instance at exactly that placement with its
  whole compute instance; ``create_fit(index, cores, memory)``: the smallest profile that
  covers a share (agent/domain/migfit.py) where it fits. Refused with a ``DynamicMigError``
  saying why: the GPU is not on dynamic MIG, has no MIG, its MIG mode is off or pending a
  reset, the placement is taken (naming the instance that holds it), nothing covers the share
  or nothing covering it fits, or the driver refused (its NVML error).
- ``destroy(index, gi, ci)``: that instance (already gone is success); the driver refuses
  while a process uses it (IN_USE), and the error says so.
- ``reconcile(held)``: at start and every ``DRA_MIG_RECONCILE_S``: on each dynamic GPU,
  MIG mode is enabled when it is off and the GPU has no processes (it may stay pending until
  a GPU reset, which the agent never does), and every instance that no prepared claim holds
  is destroyed (one a process uses stays, logged, and is tried again).

MIG calls run one at a time, and an instance created for a claim that
is not recorded yet is left alone by the cleanup until ``settle`` says it is (recorded, or
destroyed again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence

from agent.control.migmode import pids_on
from agent.control.migwatch import MigWatch
from agent.domain.migfit import smallest_fit, why_not
from agent.errors import GpuError, VcudaError
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.gpu.migprofiles import (
    GpuInstanceProfile,
    MigProduct,
    Placement,
    full_ci_profile,
    product_for,
)
from agent.platform.gpu.migstate import MigDevice, MigInfo

log = logging.getLogger(__name__)


class DynamicMigError(VcudaError):
    """A MIG instance that cannot be created or destroyed for a claim; the text says why."""


class DynamicMig:
    def __init__(
        self,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        dynamic: Callable[[], Collection[int]],
        watch: MigWatch | None = None,
    ) -> None:
        """``gpus``: the DRA GPUs; ``dynamic``: the node config's ``mig.dynamic``."""
        self._backend = backend
        self._gpus = {g.index: g for g in gpus}
        self._dynamic = dynamic
        self._watch = watch
        # One lock for every GPU: the backend's MIG control is one client for one caller at a time.
        lock = threading.Lock()
        self._locks = {g.index: lock for g in gpus}
        self._told: dict[int, str] = {}  # the last reason logged per GPU
        self._unsettled: set[tuple[int, int]] = set()  # (GPU, GI) created, not yet recorded
        self._ignored: frozenset[int] = frozenset()  # configured, but not DRA GPUs (told once)

    def gpus(self) -> frozenset[int]:
        """The DRA GPUs on dynamic MIG (the config may name GPUs DRA does not have: those are
        left out, with a warning each time the list of them changes)."""
        wanted = frozenset(self._dynamic())
        ignored = wanted - self._gpus.keys()
        if ignored != self._ignored:
            self._ignored = ignored
            if ignored:
                log.warning(
                    "mig.dynamic names GPU(s) %s that DRA does not serve (see --dra-gpus): left as they are",
                    ",".join(map(str, sorted(ignored))),
                )
        return wanted - ignored

    def product(self, index: int) -> MigProduct | None:
        gpu = self._gpus.get(index)
        return None if gpu is None else product_for(gpu.model, gpu.memory_mib)

    def gpu(self, index: int) -> GpuInfo:
        return self._gpus[index]

    def ready(self) -> dict[int, MigProduct]:
        """The dynamic GPUs in MIG mode (none pending) and their products, by the MIG watch."""
        infos = self._watch.snapshot()[1] if self._watch is not None else {}
        found = {}
        for index in sorted(self.gpus()):
            product, info = self.product(index), infos.get(index)
            why = _not_ready(index, product, info)
            self._tell(index, why)
            if product is not None and not why:
                found[index] = product
        return found

    # Per claim ---------------------------------------------------------------------------
    def create(self, index: int, profile: GpuInstanceProfile, placement: Placement) -> MigDevice:
        with self._locks[index]:
            product, info = self._usable(index)
            for device in info.devices:
                held = Placement(device.placement_start, device.placement_size)
                if held.overlaps(placement):
                    raise DynamicMigError(
                        f"GPU {index}: placement {placement} of {profile.name} is taken by GPU instance "
                        f"{device.gi} ({device.gi_profile} at {held})"
                    )
            return self._create(index, product, profile, placement)

    def create_fit(self, index: int, cores: int, memory_mib: int) -> MigDevice:
        """The smallest profile covering ``cores``% and ``memory_mib``, where it fits."""
        with self._locks[index]:
            product, info = self._usable(index)
            existing = []
            for device in info.devices:
                gi_profile = product.by_id(device.gi_profile_id)
                if gi_profile is not None:
                    existing.append((gi_profile, Placement(device.placement_start, device.placement_size)))
            fit = smallest_fit(product, cores, memory_mib, existing)
            if fit is None:
                raise DynamicMigError(f"GPU {index}: {why_not(product, cores, memory_mib)}")
            return self._create(index, product, fit.profile, fit.placement)

    def settle(self, instances: Collection[tuple[int, int]]) -> None:
        """(GPU, GI) created for a claim are now recorded with it (or destroyed again)."""
        for index, gi in instances:
            if index in self._locks:
                with self._locks[index]:
                    self._unsettled.discard((index, gi))

    def destroy(self, index: int, gi: int, ci: int) -> None:
        if index not in self._locks:
            return
        with self._locks[index]:
            try:
                info = self._backend.mig(index)
            except GpuError as err:
                raise DynamicMigError(f"GPU {index}: cannot read its MIG state: {err}") from err
            if not any(d.gi == gi for d in info.devices):
                return  # gone already (a GPU reset): nothing to undo
            cis = [d.ci for d in info.devices if d.gi == gi and d.ci == ci] or [ci]
            try:
                self._backend.mig_control().destroy(index, gi, cis)
            except GpuError as err:
                raise DynamicMigError(f"{err} (the instance stays)") from err
            finally:
                self._refresh()

    def reconcile(self, held: Collection[tuple[int, int]]) -> None:
        """MIG mode on where it is off and idle; instances no claim holds ((GPU, GI) in
        ``held``) destroyed. Never raises: what fails is logged and tried again next time."""
        for index in sorted(self.gpus()):
            with self._locks[index]:
                keep = {gi for i, gi in (*held, *self._unsettled) if i == index}
                try:
                    self._reconcile(index, keep)
                except GpuError as err:
                    self._tell(index, f"GPU {index}: dynamic MIG: {err}")
        self._refresh()

    def _reconcile(self, index: int, held: set[int]) -> None:
        info = self._backend.mig(index)
        if not info.capable:
            self._tell(
                index, f"GPU {index} ({self._gpus[index].model}) has no MIG: dynamic MIG is off for it"
            )
            return
        if not info.current and not info.pending:
            pids = pids_on(self._backend, index)
            if pids:
                self._tell(index, f"GPU {index}: MIG mode is off and processes use it ({pids})")
                return
            pending = self._backend.mig_control().set_mode(index, True)
            log.info("GPU %d: MIG mode enabled for dynamic MIG%s", index, ", pending a GPU reset" * pending)
            return
        strays = [d for d in info.devices if d.gi not in held] if info.current else []
        if not strays:
            return  # nothing to destroy, or MIG mode pending a reset (no instance exists)
        control = self._backend.mig_control()
        for device in strays:
            try:
                control.destroy(index, device.gi, [device.ci])
                log.info("GPU %d: destroyed %s (GPU instance %d): no prepared claim holds it", index,
                         device.profile, device.gi)  # fmt: skip
            except GpuError as err:
                log.warning("GPU %d: GPU instance %d, held by no claim, stays: %s", index, device.gi, err)

    def _usable(self, index: int) -> tuple[MigProduct, MigInfo]:
        if index not in self.gpus():
            raise DynamicMigError(
                f"GPU {index} is not on dynamic MIG (node config mig.dynamic): "
                "it has no MIG instances to give"
            )
        product = self.product(index)
        try:
            info = self._backend.mig(index)
        except GpuError as err:
            raise DynamicMigError(f"GPU {index}: cannot read its MIG state: {err}") from err
        why = _not_ready(index, product, info)
        if product is None or why:
            raise DynamicMigError(why)
        return product, info

    def _create(
        self, index: int, product: MigProduct, profile: GpuInstanceProfile, placement: Placement
    ) -> MigDevice:
        try:
            gi, ci = self._backend.mig_control().create(
                index, profile, placement, full_ci_profile(profile, product)
            )
            info = self._backend.mig(index)
        except GpuError as err:
            raise DynamicMigError(str(err)) from err
        finally:
            self._refresh()
        self._unsettled.add((index, gi))
        device = next((d for d in info.devices if (d.gi, d.ci) == (gi, ci)), None)
        if device is None:
            raise DynamicMigError(f"GPU {index}: GPU instance {gi} was created but is not listed")
        return device

    def _refresh(self) -> None:
        if self._watch is not None:
            self._watch.refresh()

    def _tell(self, index: int, why: str) -> None:
        if self._told.get(index, "") != why:
            self._told[index] = why
            if why:
                log.warning("%s", why)


def _not_ready(index: int, product: MigProduct | None, info: MigInfo | None) -> str:
    """Why GPU ``index`` cannot serve dynamic MIG now ("": it can)."""
    if product is None or (info is not None and not info.capable):
        return f"GPU {index} has no MIG: dynamic MIG cannot serve it"
    if info is None or not info.current:
        pending = info is not None and info.pending
        return (
            f"GPU {index}: MIG mode is {'enabled, pending a GPU reset' if pending else 'off'} "
            f"(nvidia-smi --gpu-reset -i {index} applies a pending mode); its MIG devices are not offered"
        )
    if info.change_pending:
        return (
            f"GPU {index}: MIG mode is to be disabled at the next GPU reset; its MIG devices are not offered"
        )
    return ""
