"""Which MIG profile serves a share that asks for hardware isolation.

A share is ``cores`` of ``nvidia.com/vcuda-core`` (a percentage of the whole GPU's
throughput) and ``memory_mib`` of ``nvidia.com/vcuda-memory``. A GPU instance profile
*covers* it when its SMs are at least that share of the whole GPU's SMs (a MIG device of
``s`` SMs on a GPU of ``S`` runs at most ``s/S`` of the GPU's throughput, whatever it
queues) and its memory is at least the memory asked. The profile that serves it is the
smallest that covers it (fewest compute slices, then fewest memory slices) and still fits
beside the GPU's instances; media-engine (``+me``) profiles are never chosen: they hold the
GPU's only media engines.

Pure functions over the profile tables; nothing here talks to NVML.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.platform.gpu.migprofiles import (
    GpuInstanceProfile,
    MigProduct,
    Placement,
    placements_by_preference,
    remaining_capacity,
)

RULE = (
    "a share is served by the smallest MIG profile whose SMs are at least its vcuda-core share "
    "of the GPU's SMs and whose memory is at least its vcuda-memory"
)


@dataclass(frozen=True)
class MigFit:
    """A profile for a share, and where on the GPU it goes."""

    profile: GpuInstanceProfile
    placement: Placement


def covers(gpu: MigProduct, profile: GpuInstanceProfile, cores: int, memory_mib: int) -> bool:
    """Whether ``profile`` gives at least ``cores``% of ``gpu``'s throughput and ``memory_mib``."""
    return profile.sm_count * 100 >= cores * gpu.sm_count and profile.memory_mib >= memory_mib


def covering_profiles(gpu: MigProduct, cores: int, memory_mib: int) -> list[GpuInstanceProfile]:
    """The plain profiles of ``gpu`` that cover the share, smallest first."""
    fitting = [p for p in gpu.profiles if not p.media and covers(gpu, p, cores, memory_mib)]
    return sorted(fitting, key=lambda p: (p.slices, p.memory_slices, p.memory_mib, p.index))


def smallest_fit(
    gpu: MigProduct,
    cores: int,
    memory_mib: int,
    existing: Sequence[tuple[GpuInstanceProfile, Placement]] = (),
) -> MigFit | None:
    """The smallest covering profile that fits beside ``existing`` (each instance's profile
    and placement), at the placement that leaves the most room for others; None when none
    does (:func:`why_not` says why)."""
    for profile in covering_profiles(gpu, cores, memory_mib):
        if remaining_capacity(profile, existing) == 0:
            continue
        places = placements_by_preference(gpu, profile, existing)
        if places:
            return MigFit(profile, places[0])
    return None


def why_not(gpu: MigProduct, cores: int, memory_mib: int) -> str:
    """Why :func:`smallest_fit` found nothing, as a user should read it."""
    if cores <= 0 or memory_mib < 0:
        return f"a hardware-isolated share needs vcuda-core > 0 (asked {cores}) and vcuda-memory >= 0"
    covering = covering_profiles(gpu, cores, memory_mib)
    if not covering:
        largest = max((p for p in gpu.profiles if not p.media), key=lambda p: p.sm_count)
        pct = largest.sm_count * 100 // gpu.sm_count
        return (
            f"no {gpu.key} MIG profile covers {cores} cores and {memory_mib} MiB: the largest, "
            f"{largest.name}, has {pct}% of the GPU's SMs and {largest.memory_mib} MiB ({RULE})"
        )
    names = ", ".join(p.name for p in covering)
    return (
        f"no room on the GPU for a MIG instance of {names} "
        f"(the profiles that cover {cores} cores and {memory_mib} MiB)"
    )
