"""The MIG side of a GPU in the status document (``gpus[].mig``: schema in
``surfaces/statusview.py``), built from the backend's MIG state and the instances' health."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict, cast

from agent.control.migsharebook import IsolatedShare
from agent.domain.health import GpuHealth
from agent.domain.miginventory import encode_mig, mig_entry
from agent.platform.gpu.migstate import MigDevice, MigInfo


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


class MigGeometryStatus(TypedDict):
    wanted: list[str]  # the node config's GPU instances for this GPU
    state: str  # applied, pending (a GPU reset), waiting (processes), refused
    reason: str


class IsolatedShareStatus(TypedDict):
    pod: str  # namespace/name
    podUID: str
    container: str
    profile: str
    uuid: str
    gi: int
    cores: int
    memoryMiB: int


class MigStatus(TypedDict):
    mode: str
    pending: str
    devices: list[MigDeviceStatus]
    strategy: NotRequired[str]  # the node config's: none, single, mixed
    shares: NotRequired[str | None]  # why the GPU offers no vcuda-core/vcuda-memory (None: it does)
    geometry: NotRequired[MigGeometryStatus | None]  # None: no geometry configured for it
    onDemand: NotRequired[bool]  # serves hardware-isolated shares (mig.onDemand)
    isolated: NotRequired[list[IsolatedShareStatus]]  # the MIG instances made for shares


def mig_statuses(
    infos: Mapping[int, MigInfo], unhealthy: Mapping[tuple[int, int], GpuHealth]
) -> dict[int, MigStatus]:
    """``gpus[].mig`` of every MIG-capable GPU, by index; ``unhealthy``: the Unhealthy GPU
    instances by (GPU index, GI id). The fields the inventory annotation has too are its
    encoding of them (``domain/miginventory.py``)."""
    statuses: dict[int, MigStatus] = {}
    for index, info in infos.items():
        entry = mig_entry(info, (gi for gpu, gi in unhealthy if gpu == index))
        if entry is None:
            continue
        encoded = encode_mig(entry)
        devices = [
            _device_status(d, shared, unhealthy.get((index, d.gi)))
            for d, shared in zip(info.devices, encoded["devices"], strict=True)
        ]
        statuses[index] = MigStatus(mode=encoded["mode"], pending=encoded["pending"], devices=devices)
    return statuses


def add_mig_config(
    statuses: dict[int, MigStatus],
    strategy: str,
    withheld: Mapping[int, str],
    geometry: Mapping[int, MigGeometryStatus],
) -> dict[int, MigStatus]:
    """The MIG strategy, each GPU's geometry and why it offers no shares, into ``statuses``."""
    for index, status in statuses.items():
        status["strategy"] = strategy
        status["shares"] = withheld.get(index)
        status["geometry"] = geometry.get(index)
    return statuses


def _device_status(device: MigDevice, shared: dict[str, Any], bad: GpuHealth | None) -> MigDeviceStatus:
    fields = {key: value for key, value in shared.items() if key != "healthy"}
    fields.update(
        smCount=device.sm_count,
        health="Healthy" if bad is None else "Unhealthy",
        healthReason=None if bad is None else bad.reason,
        capDevices=list(device.cap_devices),
    )
    return cast(MigDeviceStatus, fields)


def add_isolated_shares(
    statuses: dict[int, MigStatus], on_demand: frozenset[int], shares: Sequence[IsolatedShare]
) -> dict[int, MigStatus]:
    """Each on-demand GPU's isolated shares (``onDemand``, ``isolated``) into ``statuses``."""
    for index, status in statuses.items():
        if index not in on_demand:
            continue
        status["onDemand"] = True
        status["isolated"] = [
            IsolatedShareStatus(
                pod=f"{s.namespace}/{s.pod}",
                podUID=s.pod_uid,
                container=s.container,
                profile=s.profile,
                uuid=s.uuid,
                gi=s.gi,
                cores=s.cores,
                memoryMiB=s.memory_mib,
            )
            for s in shares
            if s.gpu == index
        ]
    return statuses
