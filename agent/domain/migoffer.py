"""What the node offers of its MIG devices, by strategy, and which GPUs offer no shares.

As NVIDIA's device plugin names them: strategy ``mixed`` offers one extended resource per
profile, ``nvidia.com/mig-<profile>`` (``+`` is not allowed in a resource name, so
``1g.10gb+me`` is ``nvidia.com/mig-1g.10gb.me``), each device a whole MIG device (a GPU
instance with one compute instance); ``single`` offers every MIG device as
``nvidia.com/gpu``, and only while they are all of one profile (otherwise none, with
why); ``none`` offers no MIG device. Device IDs are the MIG devices' UUIDs (``MIG-...``).

A GPU in MIG mode (or with MIG mode pending, or with a geometry the agent is about to
apply) offers no vcuda-core or vcuda-memory of its own: it is *withheld*, with why.
A MIG device is Unhealthy with its GPU or its GPU instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.domain.health import GpuHealth
from agent.domain.migconfig import MigStrategy
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migstate import MigDevice, MigInfo

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
SINGLE_RESOURCE = "nvidia.com/gpu"


def mig_resource(profile: str) -> str:
    """``nvidia.com/mig-3g.40gb`` for a MIG device of profile ``3g.40gb``."""
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


@dataclass(frozen=True)
class OfferedDevice:
    """One MIG device as a resource offers it."""

    device: MigDevice
    gpu: GpuInfo  # its parent GPU
    healthy: bool = True
    reason: str = ""  # why it is Unhealthy

    @property
    def id(self) -> str:
        return self.device.uuid


@dataclass(frozen=True)
class MigOffer:
    resources: Mapping[str, tuple[OfferedDevice, ...]] = field(default_factory=dict)
    withheld: Mapping[int, str] = field(default_factory=dict)  # GPU index -> why it offers no shares
    problem: str = ""  # why MIG devices that exist are not offered ("" when they all are)

    def find(self, device_id: str) -> tuple[str, OfferedDevice] | None:
        """The resource and device of a device ID."""
        for resource, devices in self.resources.items():
            for offered in devices:
                if offered.id == device_id:
                    return resource, offered
        return None


def mig_offer(
    strategy: MigStrategy,
    *,
    infos: Mapping[int, MigInfo],
    gpus: Sequence[GpuInfo],
    health: Mapping[int, GpuHealth],
    unhealthy_gis: Mapping[tuple[int, int], GpuHealth],
    draining: Iterable[int] = (),
) -> MigOffer:
    """``draining``: GPUs the agent is about to put a MIG geometry on (withheld too)."""
    by_index = {g.index: g for g in gpus}
    offered: list[tuple[str, OfferedDevice]] = []
    for index, info in sorted(infos.items()):
        gpu = by_index.get(index)
        if gpu is None or not info.current:
            continue
        for device in info.devices:
            offered.append((mig_resource(device.profile), _device(device, gpu, health, unhealthy_gis)))
    resources: dict[str, list[OfferedDevice]] = {}
    problem = ""
    if strategy is MigStrategy.NONE:
        problem = "" if not offered else "MIG strategy none: the MIG devices are not offered"
    elif strategy is MigStrategy.SINGLE:
        profiles = sorted({d.device.profile for _, d in offered})
        if len(profiles) > 1:
            problem = (
                "MIG strategy single offers the MIG devices as nvidia.com/gpu only while they are all "
                f"of one profile; this node has {', '.join(profiles)} (use mixed, or one profile)"
            )
        elif offered:
            resources[SINGLE_RESOURCE] = [d for _, d in offered]
    else:
        for name, offered_device in offered:
            resources.setdefault(name, []).append(offered_device)
    return MigOffer(
        {name: tuple(devices) for name, devices in resources.items()},
        _withheld(strategy, infos, set(draining), problem),
        problem,
    )


def _device(
    device: MigDevice,
    gpu: GpuInfo,
    health: Mapping[int, GpuHealth],
    unhealthy_gis: Mapping[tuple[int, int], GpuHealth],
) -> OfferedDevice:
    state = health.get(gpu.index)
    if state is not None and not state.healthy:
        return OfferedDevice(device, gpu, False, f"GPU {gpu.index} is Unhealthy: {state.reason}")
    bad = unhealthy_gis.get((gpu.index, device.gi))
    if bad is not None:
        return OfferedDevice(device, gpu, False, f"GPU instance {device.gi} is Unhealthy: {bad.reason}")
    return OfferedDevice(device, gpu)


def _withheld(
    strategy: MigStrategy, infos: Mapping[int, MigInfo], draining: set[int], problem: str
) -> dict[int, str]:
    withheld: dict[int, str] = {}
    for index, info in sorted(infos.items()):
        if info.current:
            served = f"not offered ({problem})" if problem else f"offered by MIG strategy {strategy}"
            withheld[index] = f"in MIG mode: it offers no shares of its own; its MIG devices are {served}"
        elif info.pending:
            withheld[index] = "MIG mode enabled, pending a GPU reset: it offers no shares of its own"
        elif index in draining:
            withheld[index] = "a MIG geometry waits for it to be idle: it takes no new shares"
    return withheld
