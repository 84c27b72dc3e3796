"""The GPU server's MIG side: each GPU's MIG state (:mod:`.mig`) and, for every MIG device,
an engine of its own that executes its contexts' work on the device's share of the SMs and
in its GPU instance's memory.

Isolation is by construction: a MIG device's contexts are scheduled on their own engine,
which no other device's contexts reach. The work of a kernel is given in seconds of the
whole GPU; on a device of ``s`` SMs of a GPU of ``S`` it takes ``S / s`` times as long, so
a workload there gets at most ``s / S`` of the GPU's throughput whatever it queues (a 2g
device of an H100: 32 of 132 SMs, under 2/7), and its neighbours change nothing. Memory is
the GPU instance's, shared by its compute instances. NVML's utilization figures are
NOT_SUPPORTED on a GPU in MIG mode and on its devices; a GPM-like activity per GPU
instance (``gpm_sample``: SM-busy seconds so far) stands in, as GPM metrics do on Hopper.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import InvalidSpecError, PlatformError
from agent.platform.gpu.migprofiles import MigProduct, Placement, full_ci_profile
from agent.platform.gpu.nvmlcodes import NVML_ERROR_NOT_SUPPORTED
from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.driverstate import DriverState
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import check_allocation
from agent.platform.gpu.sim.mig import ComputeInstance, GpuInstance, MigError, MigGpu
from agent.platform.gpu.sim.nodefile import SimNode
from agent.platform.gpu.sim.replies import RequestError, gpu_field
from agent.platform.procfs import ProcFS

log = logging.getLogger(__name__)


@dataclass
class MigEngine:
    """The engine of one MIG device and where it sits."""

    gpu: int
    gi: int
    ci: int
    uuid: str
    engine: GpuEngine
    rate: float  # its share of the whole GPU's throughput (its SMs / the GPU's)


class MigHost:
    """Every GPU's MIG state and its devices' engines (see the module docstring)."""

    def __init__(
        self,
        node: SimNode,
        configs: Sequence[EngineConfig],
        engines: Sequence[GpuEngine],
        wall_offset_s: float,
        products: Sequence[MigProduct | None],
    ) -> None:
        self.gpus = [
            MigGpu(slot.index, slot.index, slot.uuid, products[i] if i < len(products) else None)
            for i, slot in enumerate(node.gpus)
        ]
        self._configs = configs
        self._engines = engines
        self._wall_offset = wall_offset_s
        self.devices: dict[str, MigEngine] = {}

    # Set-up -----------------------------------------------------------------------------------
    def enable(self, gpu: int, geometry: Sequence[str], now: float) -> None:
        """MIG mode on from the start (``sim-gpu --mig``), with a GPU instance and its whole
        compute instance for each profile name in ``geometry``, created in that order."""
        mig = self.gpus[gpu]
        try:
            mig.set_mode(1, None)
            mig.reset(None)
            for name in geometry:
                product = mig.require_capable()
                profile = product.by_name(name)
                if profile is None:
                    names = ", ".join(p.name for p in product.profiles)
                    raise InvalidSpecError(f"--mig: {product.key} has no profile {name!r} ({names})")
                instance = mig.create_gi(profile.id)
                self._add_ci(mig, instance, full_ci_profile(profile, product).index, now)
        except MigError as err:
            raise InvalidSpecError(f"--mig for GPU {gpu}: {err}") from err

    # Lookups ----------------------------------------------------------------------------------
    def device(self, uuid: str) -> MigEngine:
        found = self.devices.get(uuid)
        if found is None:
            raise RequestError(f"no MIG device {uuid!r} on the simulated node")
        return found

    def physical(self, gpu: int) -> GpuEngine:
        """The GPU's own engine (its contexts out of MIG mode)."""
        return self._engines[gpu]

    def engines_of(self, gpu: int) -> list[MigEngine]:
        return [d for d in self.devices.values() if d.gpu == gpu]

    def in_mig_mode(self, gpu: int) -> bool:
        return self.gpus[gpu].current

    def busy(self, gpu: int) -> str | None:
        """Why the GPU counts as in use (processes on it or its MIG devices), or None."""
        engine = self._engines[gpu]
        pids = {c.pid for c in engine.contexts}
        for dev in self.engines_of(gpu):
            pids.update(c.pid for c in dev.engine.contexts)
        if engine.mps_server_pid is not None:
            pids.add(engine.mps_server_pid)
        if not pids:
            return None
        return f"{len(pids)} process(es) use it (pids {', '.join(map(str, sorted(pids)))})"

    # Contexts ---------------------------------------------------------------------------------
    def open_context(
        self, gpu: int, uuid: str, driver: DriverState, procfs: ProcFS, *, pid: int, now: float
    ) -> tuple[MigEngine, Context]:
        """A process's new context on MIG device ``uuid`` of GPU ``gpu``, and the device."""
        dev = self.device(uuid)
        if dev.gpu != gpu:
            raise RequestError(f"MIG device {uuid} is on GPU {dev.gpu}, not GPU {gpu}")
        if dev.engine.lost:
            raise RequestError(f"GPU {gpu} is lost (fell off the bus)")
        try:
            start_ticks = procfs.identity(pid).start_ticks
        except PlatformError as err:
            raise RequestError(f"cannot identify the client process {pid}: {err}") from err
        return dev, dev.engine.create_context(pid, start_ticks, now, cgroup=driver.cgroup_of(pid))

    def allocate(self, uuid: str, ctx: Context, nbytes: int) -> None:
        """Device memory for a context on a MIG device: within its GPU instance's memory,
        which the GI's compute instances share."""
        dev = self.device(uuid)
        if nbytes > 0:
            siblings = [c for d in self.engines_of(dev.gpu) if d.gi == dev.gi for c in d.engine.contexts]
            check_allocation(
                ctx, nbytes, gpu=dev.gpu, capacity=dev.engine.config.memory_bytes, contexts=siblings,
                cgroup_limits={},
            )  # fmt: skip
        dev.engine.allocate(ctx, nbytes)

    def memory_of(self, gpu: int) -> dict[int, int]:
        """Memory per pid held on the GPU's MIG devices (NVML lists them on the parent GPU)."""
        used: dict[int, int] = {}
        for dev in self.engines_of(gpu):
            for pid, held in dev.engine.memory().items():
                used[pid] = used.get(pid, 0) + held
        return used

    def set_lost(self, gpu: int, lost: bool, now: float) -> list[Context]:
        gone: list[Context] = []
        for dev in self.engines_of(gpu):
            gone += dev.engine.set_lost(lost, now)
        return gone

    # Instances --------------------------------------------------------------------------------
    def add_ci(
        self, gpu: int, gi_id: int, profile_id: int, now: float, placement: Placement | None = None
    ) -> ComputeInstance:
        mig = self.gpus[gpu]
        return self._add_ci(mig, mig.gi(gi_id), profile_id, now, placement)

    def _add_ci(
        self,
        mig: MigGpu,
        instance: GpuInstance,
        profile_id: int,
        now: float,
        placement: Placement | None = None,
    ) -> ComputeInstance:
        ci = mig.create_ci(instance.id, profile_id, placement)
        product = mig.require_capable()
        config = dataclasses.replace(
            self._configs[mig.index],
            memory_bytes=instance.profile.memory_mib << 20,
            sm_count=ci.profile.sm_count,
            mps=False,
            mps_curve=None,
        )
        engine = GpuEngine(config, now, self._wall_offset, index=mig.index)
        engine.lost = self._engines[mig.index].lost
        rate = ci.profile.sm_count / product.sm_count
        self.devices[ci.uuid] = MigEngine(mig.index, instance.id, ci.id, ci.uuid, engine, rate)
        log.info(
            "GPU %d: MIG device %s (GI %d CI %d, %s at %s) created",
            mig.index, ci.uuid, instance.id, ci.id, ci.profile.name, instance.placement,
        )  # fmt: skip
        return ci

    def destroy_ci(self, gpu: int, gi_id: int, ci_id: int) -> None:
        mig = self.gpus[gpu]
        ci = mig.ci(gi_id, ci_id)
        dev = self.devices.get(ci.uuid)
        pids = sorted({c.pid for c in dev.engine.contexts}) if dev is not None else []
        busy = f"processes {', '.join(map(str, pids))} use it" if pids else None
        mig.destroy_ci(gi_id, ci_id, busy)
        self.devices.pop(ci.uuid, None)

    def reset(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        """``gpu_reset``: what ``nvidia-smi --gpu-reset`` does to MIG: the pending mode
        applies, every instance goes; refused while processes use the GPU."""
        gpu = gpu_field(request, self._engines)
        mig = self.gpus[gpu]
        for uuid in mig.reset(self.busy(gpu)):
            self.devices.pop(uuid, None)
        log.info("GPU %d reset: MIG mode %s", gpu, "enabled" if mig.current else "disabled")
        return {"ok": True, "current": int(mig.current), "pending": int(mig.pending)}

    # Replies ----------------------------------------------------------------------------------
    def state_reply(self) -> dict[str, Any]:
        """``mig_state``: every GPU's MIG mode and devices, as a backend reports them."""
        gpus = []
        for mig in self.gpus:
            info = mig.info()
            gpus.append(
                {
                    "index": mig.index,
                    "capable": info.capable,
                    "current": info.current,
                    "pending": info.pending,
                    "devices": [dataclasses.asdict(d) for d in info.devices],
                }
            )
        return {"ok": True, "gpus": gpus}

    def truth_reply(self, now: float) -> dict[str, Any]:
        """``mig_truth``: exact figures per MIG device; ``work_s`` is in seconds of the whole
        GPU (what the device's kernels would have taken on all of its SMs)."""
        devices = []
        for dev in self.devices.values():
            contexts = [
                {"pid": c.pid, "ran_s": c.ran_s, "work_s": c.ran_s * dev.rate, "queued": c.queued,
                 "memory_bytes": c.memory_bytes}
                for c in dev.engine.truth(now)
            ]  # fmt: skip
            devices.append(
                {
                    "gpu": dev.gpu, "gi": dev.gi, "ci": dev.ci, "uuid": dev.uuid, "rate": dev.rate,
                    "busy_s": dev.engine.busy_s, "work_s": dev.engine.work_s * dev.rate, "contexts": contexts,
                }
            )  # fmt: skip
        return {"ok": True, "monotonic": now, "wall": now + self._wall_offset, "devices": devices}

    def gpm_sample(self, gpu: int, gi_id: int, now: float) -> dict[str, Any]:
        """``nvmlGpmMigSampleGet``-like: the GI's SM-busy seconds so far (its CIs' busy time
        weighted by their SMs), at ``now``; two samples make an activity percentage."""
        mig = self.gpus[gpu]
        instance = mig.gi(gi_id)
        busy = 0.0
        for dev in self.engines_of(gpu):
            if dev.gi == gi_id:
                dev.engine.advance(now)
                ci = instance.cis[dev.ci]
                busy += dev.engine.busy_s * ci.profile.sm_count / instance.profile.sm_count
        return {"timestamp": now + self._wall_offset, "sm_busy_s": busy}

    def utilization_refused(self, gpu: int, uuid: str | None) -> None:
        """NVML's utilization calls are NOT_SUPPORTED on MIG devices and on a GPU in MIG mode."""
        if uuid is not None:
            self.device(uuid)
            raise MigError(NVML_ERROR_NOT_SUPPORTED, f"utilization is not supported on MIG device {uuid}")
        if self.gpus[gpu].current:
            raise MigError(NVML_ERROR_NOT_SUPPORTED, f"utilization is not supported on GPU {gpu} in MIG mode")

    def check_event_gi(self, gpu: int, gi: object) -> int | None:
        """The GPU instance an injected event names (None: the GPU itself)."""
        if gi is None:
            return None
        mig = self.gpus[gpu]
        if isinstance(gi, bool) or not isinstance(gi, int) or gi not in mig.gis:
            raise RequestError(f"GPU {gpu} has no GPU instance {gi!r} (has {sorted(mig.gis)})")
        return gi


def mig_memory(extra: Mapping[int, int], memory: list[list[int]]) -> list[list[int]]:
    """A poll's ``memory`` rows of a GPU with its MIG devices' memory added per pid."""
    merged = {int(pid): int(held) for pid, held in memory}
    for pid, held in extra.items():
        merged[pid] = merged.get(pid, 0) + held
    return [[pid, held] for pid, held in merged.items()]
