"""Device IDs of ``nvidia.com/vcuda-core``: 100 per GPU, each naming its GPU.

An ID is ``<GPU UUID>-vcore-<NN>`` (e.g. ``GPU-6b1c...-vcore-07``). The UUID is
stable across reboots and driver reloads, unlike the GPU index, so IDs that
kubelet checkpointed keep pointing at the same GPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import DeviceIdError
from agent.platform.gpu.inventory import GpuInfo

UNITS_PER_GPU = 100
MAX_ID_LENGTH = 63  # kubelet's limit for a device ID
_SEPARATOR = "-vcore-"
_ID = re.compile(r"^(?P<uuid>[A-Za-z0-9][A-Za-z0-9-]*)-vcore-(?P<unit>\d{2})$")


@dataclass(frozen=True, order=True)
class CoreUnit:
    gpu_uuid: str
    unit: int


def encode(gpu_uuid: str, unit: int) -> str:
    if not 0 <= unit < UNITS_PER_GPU:
        raise DeviceIdError(f"unit {unit} is outside 0..{UNITS_PER_GPU - 1}")
    device_id = f"{gpu_uuid}{_SEPARATOR}{unit:02d}"
    if len(device_id) > MAX_ID_LENGTH or _ID.fullmatch(device_id) is None:
        raise DeviceIdError(
            f"GPU UUID {gpu_uuid!r} cannot form a device ID of at most {MAX_ID_LENGTH} "
            "letters, digits and dashes"
        )
    return device_id


def decode(device_id: str) -> CoreUnit:
    match = _ID.fullmatch(device_id)
    if match is None:
        raise DeviceIdError(f"{device_id!r} is not a vcuda-core device ID (<GPU UUID>-vcore-NN)")
    return CoreUnit(match["uuid"], int(match["unit"]))


def ids_for_gpu(gpu_uuid: str) -> list[str]:
    return [encode(gpu_uuid, unit) for unit in range(UNITS_PER_GPU)]


class IdTable:
    """Every device ID of a node mapped to its (GPU index, unit); built once, so hot
    paths (GetPreferredAllocation, Allocate) look IDs up instead of parsing them."""

    def __init__(self, gpus: Sequence[GpuInfo]) -> None:
        self.ids_by_gpu = {g.index: ids_for_gpu(g.uuid) for g in gpus}
        self._where = {
            d: (index, unit) for index, ids in self.ids_by_gpu.items() for unit, d in enumerate(ids)
        }

    def locate_all(self, device_ids: Sequence[str]) -> list[tuple[int, int]]:
        """``locate`` for many IDs at once (the lookups run at C speed)."""
        try:
            return list(map(self._where.__getitem__, device_ids))
        except KeyError:
            return [self.locate(d) for d in device_ids]  # raises with the offending ID named

    def locate(self, device_id: str) -> tuple[int, int]:
        found = self._where.get(device_id)
        if found is None:
            unit = decode(device_id)  # raises for a malformed ID
            raise DeviceIdError(
                f"device ID {device_id!r} names GPU {unit.gpu_uuid}, which this node does not have"
            )
        return found
