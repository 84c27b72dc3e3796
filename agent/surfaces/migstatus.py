"""The MIG side of a GPU in the status document (``gpus[].mig``: schema in
``surfaces/statusview.py``), built from the backend's MIG state and the instances' health."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from agent.domain.health import GpuHealth
from agent.platform.gpu.migstate import MigInfo


class MigDeviceStatus(TypedDict):
    gi: int
    ci: int
    profile: str
    uuid: str
    placement: str
    memoryMiB: int
    smCount: int
    health: str
    healthReason: str | None
    capDevices: list[str]


class MigStatus(TypedDict):
    mode: str
    pending: str
    devices: list[MigDeviceStatus]


def mig_statuses(
    infos: Mapping[int, MigInfo], unhealthy: Mapping[tuple[int, int], GpuHealth]
) -> dict[int, MigStatus]:
    """``gpus[].mig`` of every MIG-capable GPU, by index; ``unhealthy``: the Unhealthy GPU
    instances by (GPU index, GI id)."""
    statuses: dict[int, MigStatus] = {}
    for index, info in infos.items():
        if not info.capable:
            continue
        devices = []
        for d in info.devices:
            bad = unhealthy.get((index, d.gi))
            devices.append(
                MigDeviceStatus(
                    gi=d.gi,
                    ci=d.ci,
                    profile=d.profile,
                    uuid=d.uuid,
                    placement=f"{d.placement_start}:{d.placement_size}",
                    memoryMiB=d.memory_mib,
                    smCount=d.sm_count,
                    health="Healthy" if bad is None else "Unhealthy",
                    healthReason=None if bad is None else bad.reason,
                    capDevices=list(d.cap_devices),
                )
            )
        statuses[index] = MigStatus(
            mode="enabled" if info.current else "disabled",
            pending="enabled" if info.pending else "disabled",
            devices=devices,
        )
    return statuses
