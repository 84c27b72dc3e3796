"""The rules of a ``nvidia.com/vcuda-core`` request and what a set of IDs means."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.domain.ids import UNITS_PER_GPU, IdTable
from agent.errors import AllocationError
from agent.platform.gpu.inventory import GpuInfo

CORE_RULE = (
    "nvidia.com/vcuda-core must be below 100 (a share of one GPU) or a multiple of 100 (that many whole GPUs)"
)


def check_core_request(cores: int) -> None:
    """Raise ``AllocationError`` stating the rule when ``cores`` breaks it."""
    if cores <= 0:
        raise AllocationError(f"a request of {cores} vcuda-core is invalid: {CORE_RULE}")
    if cores > UNITS_PER_GPU and cores % UNITS_PER_GPU:
        raise AllocationError(f"a request of {cores} vcuda-core is invalid: {CORE_RULE}, e.g. 50 or 200")


def is_whole(cores: int) -> bool:
    return cores >= UNITS_PER_GPU


@dataclass(frozen=True)
class ResolvedRequest:
    """What a container's device IDs mean: which GPUs, how many cores."""

    cores: int
    gpus: tuple[GpuInfo, ...]

    @property
    def whole(self) -> bool:
        return is_whole(self.cores)


def resolve_ids(
    gpus: Sequence[GpuInfo], device_ids: Iterable[str], table: IdTable | None = None
) -> ResolvedRequest:
    """Map IDs to GPUs and check they form a valid request (Allocate's rules)."""
    table = table or IdTable(gpus)
    per_gpu: dict[int, set[int]] = {}
    ids = list(device_ids)
    if len(set(ids)) != len(ids):
        raise AllocationError("the request names the same device ID more than once")
    for index, unit in table.locate_all(ids):
        per_gpu.setdefault(index, set()).add(unit)
    cores = len(ids)
    check_core_request(cores)
    indexes = sorted(per_gpu)
    if not is_whole(cores) and len(indexes) > 1:
        raise AllocationError(
            f"a request of {cores} vcuda-core is a share of one GPU, but its IDs span GPUs "
            f"{_join(indexes)}: a request below 100 must take all its IDs from one GPU"
        )
    if is_whole(cores):
        partial = [f"GPU {i} ({len(per_gpu[i])} units)" for i in indexes if len(per_gpu[i]) != UNITS_PER_GPU]
        if partial:
            raise AllocationError(
                f"a request of {cores} vcuda-core takes {cores // UNITS_PER_GPU} whole GPUs, "
                f"but its IDs cover only part of {', '.join(partial)}: "
                "a multiple of 100 must take all 100 IDs of each GPU"
            )
    by_index = {g.index: g for g in gpus}
    return ResolvedRequest(cores, tuple(by_index[i] for i in indexes))


def _join(indexes: Sequence[int]) -> str:
    names = [str(i) for i in indexes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
