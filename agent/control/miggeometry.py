"""Puts the node config's MIG geometry on the GPUs, only when it is safe, and says why not.

For each GPU the config gives a geometry (``domain/migconfig.py``), every pass:

1. the geometry is checked against the GPU's own profiles and placements before anything
   is touched (``domain/miggeometry.py``): a GPU without MIG, a profile it lacks or
   instances that do not fit are *refused*;
2. a GPU that already has exactly these GPU instances (each with one compute instance over
   all of it) is *applied*: nothing to do;
3. a GPU whose MIG mode is enabled but pending waits for its reset (*pending*: the agent
   never resets a GPU; ``nvidia-smi --gpu-reset`` or a reboot does, and MIG instances do
   not survive it);
4. a GPU with processes (NVML's compute processes: a pod's, an MPS daemon's) is left
   alone (*waiting*) and tried again;
5. otherwise MIG mode is enabled if it is off (which may leave it pending a reset, see
   3), the GPU's MIG devices are destroyed and the geometry's created, through the
   backend's NVML calls (``platform/gpu/migcontrol.py``); a refusal of the driver is
   *refused*, with its reason, and tried again at the next pass.

Each state change is logged once, kept for the status document and, with Kubernetes,
posted as an Event on the node. Nothing here raises out of a pass: a bad geometry never
stops the agent. A GPU that is *waiting* or *pending* is *draining*: it takes no new
shares (``domain/migoffer.py``), so that it can become idle.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.clock import Clock, SystemClock
from agent.control.kubeports import EventSink
from agent.control.migmode import pending_reset, pids_on
from agent.control.migwatch import MigWatch
from agent.domain.migconfig import MigConfig
from agent.domain.miggeometry import PlannedInstance, plan_geometry
from agent.errors import GpuError, MigGeometryError
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.gpu.migprofiles import product_for
from agent.platform.gpu.migstate import MigInfo
from agent.settings import MIG_GEOMETRY_RETRY_S, MIG_OFFER_POLL_S

log = logging.getLogger(__name__)


class GeometryState(enum.StrEnum):
    APPLIED = "applied"
    PENDING = "pending"  # MIG mode waits for a GPU reset
    WAITING = "waiting"  # processes on the GPU
    REFUSED = "refused"  # does not fit, no MIG, or the driver refused


_EVENT_REASONS = {
    GeometryState.APPLIED: ("MIGGeometryApplied", False),
    GeometryState.PENDING: ("MIGGeometryPendingReset", False),
    GeometryState.WAITING: ("MIGGeometryWaiting", True),
    GeometryState.REFUSED: ("MIGGeometryRefused", True),
}


@dataclass(frozen=True)
class GeometryStatus:
    wanted: tuple[str, ...]
    state: GeometryState
    reason: str


class MigGeometry:
    """The geometry applier (see the module docstring)."""

    def __init__(
        self,
        backend: GpuBackend,
        gpus: Sequence[GpuInfo],
        watch: MigWatch,
        config: Callable[[], MigConfig],
        events: EventSink | None = None,
        *,
        retry_s: float = MIG_GEOMETRY_RETRY_S,
        clock: Clock | None = None,
    ) -> None:
        self._backend = backend
        self._gpus = {g.index: g for g in gpus}
        self._watch = watch
        self._config = config
        self.events = events
        self._retry_s = retry_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._status: dict[int, GeometryStatus] = {}

    def statuses(self) -> dict[int, GeometryStatus]:
        with self._lock:
            return dict(self._status)

    def draining(self) -> set[int]:
        """GPUs the geometry waits to be idle or reset: they take no new shares."""
        waiting = (GeometryState.WAITING, GeometryState.PENDING)
        return {i for i, s in self.statuses().items() if s.state in waiting}

    def run(self, stop: threading.Event) -> None:
        """A pass at once when the config changes, and while a GPU's geometry is not applied,
        when the MIG state changes (a GPU reset) and every ``retry_s``."""
        seen, seen_mig = self._config(), self._watch.snapshot()[0]
        last = self._clock.monotonic()
        while not self._clock.sleep(MIG_OFFER_POLL_S, stop):
            config, mig = self._config(), self._watch.snapshot()[0]
            due = self._clock.monotonic() - last >= self._retry_s or mig != seen_mig
            unapplied = any(s.state is not GeometryState.APPLIED for s in self.statuses().values())
            if config != seen or (due and unapplied):
                seen, last = config, self._clock.monotonic()
                self.apply_once()
                mig = self._watch.snapshot()[0]  # its own changes do not call for another pass
            seen_mig = mig

    def apply_once(self) -> bool:
        """One pass over the configured GPUs; True when a GPU's MIG state was changed."""
        geometry = self._config().geometry
        changed = False
        with self._lock:
            for gone in [i for i in self._status if i not in geometry]:
                del self._status[gone]
        for index, names in sorted(geometry.items()):
            status, touched = self._apply(index, names)
            changed |= touched
            self._record(index, status)
        if changed:
            self._watch.refresh()
        return changed

    def _apply(self, index: int, names: tuple[str, ...]) -> tuple[GeometryStatus, bool]:
        def status(state: GeometryState, reason: str) -> GeometryStatus:
            return GeometryStatus(names, state, reason)

        gpu = self._gpus.get(index)
        if gpu is None:
            return status(GeometryState.REFUSED, f"the node has no GPU {index}"), False
        product = product_for(gpu.model, gpu.memory_mib)
        if product is None:
            return status(GeometryState.REFUSED, f"GPU {index} ({gpu.model}) has no MIG"), False
        try:
            plan = plan_geometry(product, names)
            info = self._backend.mig(index)
        except (MigGeometryError, GpuError) as err:
            return status(GeometryState.REFUSED, f"GPU {index}: {err}"), False
        if info.current and _has(info, plan):
            return status(GeometryState.APPLIED, f"GPU {index} has {_describe(names)}"), False
        if info.pending and not info.current:
            return status(GeometryState.PENDING, _pending(index)), False
        try:
            pids = pids_on(self._backend, index)
        except GpuError as err:
            return status(GeometryState.REFUSED, f"GPU {index}: cannot list its processes: {err}"), False
        if pids:
            why = f"GPU {index} has processes ({pids}): {_describe(names)} is applied once it has none"
            return status(GeometryState.WAITING, why), False
        control = self._backend.mig_control()
        try:
            if not info.current:
                if control.set_mode(index, True):
                    return status(GeometryState.PENDING, _pending(index)), True
                info = self._backend.mig(index)
            by_gi: dict[int, list[int]] = {}
            for device in info.devices:
                by_gi.setdefault(device.gi, []).append(device.ci)
            for gi, cis in sorted(by_gi.items()):
                control.destroy(index, gi, cis)
            for planned in plan:
                control.create(index, planned.profile, planned.placement, planned.ci)
        except GpuError as err:
            return status(GeometryState.REFUSED, f"{err}; tried again in {self._retry_s:.0f} s"), True
        where = ", ".join(f"{p.profile.name} at {p.placement}" for p in plan) or "no instance"
        return status(GeometryState.APPLIED, f"GPU {index}: created {where}"), True

    def _record(self, index: int, status: GeometryStatus) -> None:
        with self._lock:
            before = self._status.get(index)
            applied = GeometryState.APPLIED
            if (
                before is not None
                and before.state is status.state is applied
                and before.wanted == status.wanted
            ):
                return  # still applied: keep saying what was done
            self._status[index] = status
        if before is not None and (before.state, before.reason) == (status.state, status.reason):
            return
        bad = status.state in (GeometryState.REFUSED, GeometryState.WAITING)
        level = logging.WARNING if bad else logging.INFO
        log.log(level, "MIG geometry %s: %s", status.state, status.reason)
        if self.events is not None:
            reason, warning = _EVENT_REASONS[status.state]
            self.events.node(reason, status.reason, warning=warning)


def _has(info: MigInfo, plan: Sequence[PlannedInstance]) -> bool:
    """Whether the GPU's MIG devices are exactly the plan's GPU instances, each whole."""
    whole = [d.gi_profile for d in info.devices if d.profile == d.gi_profile]
    per_gi = {d.gi for d in info.devices}
    return len(whole) == len(info.devices) == len(per_gi) and sorted(whole) == sorted(
        p.profile.name for p in plan
    )


def _describe(names: Sequence[str]) -> str:
    return f"the MIG geometry {', '.join(names)}" if names else "MIG mode with no instance"


def _pending(index: int) -> str:
    return pending_reset(index, "the geometry is created after it")
