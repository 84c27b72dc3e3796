"""NVIDIA's MIG profile tables and placement rules, as data and pure functions.

A MIG-capable GPU has 8 memory slices and 7 compute (SM) slices. A GPU instance (GI) is
created from a *profile* (``3g.40gb``: 3 compute slices, 40 GB) at one of the profile's
*placements*: a start slot and a size on the memory slices. Two GIs may not share a
memory slice; that, and each profile's own instance count, is all that decides which
mixes fit (H100-80GB: seven ``1g.10gb``, but one ``4g.40gb`` only, as its one placement is
``{0}:4``). A GI holds compute instances (CIs) over its compute slices; a CI with a GI is a
MIG device. docs/mig.md has the tables with their sources.

The numbers are NVML's: a profile has an *index* (``NVML_GPU_INSTANCE_PROFILE_1_SLICE``...,
what ``nvmlDeviceGetGpuInstanceProfileInfo`` takes) and an *id* (19 for ``1g.10gb``, what
``nvmlDeviceCreateGpuInstance`` takes and nvidia-smi shows); compute instance profiles are
numbered by their index. Nothing here imports the simulator or NVML.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MAX_GPU_INSTANCES = 7  # nvmlDeviceGetMaxMigDeviceCount on these products
MAX_CI_PER_GI = 8  # compute instance ids 0..7 (the capability table's ci0..ci7)
MAX_GI_ID = 14  # GPU instance ids 0..14 (gi0..gi14)

# NVML_GPU_INSTANCE_PROFILE_* (the index) and NVML_COMPUTE_INSTANCE_PROFILE_*.
GI_1_SLICE, GI_2_SLICE, GI_3_SLICE, GI_4_SLICE, GI_7_SLICE = 0x0, 0x1, 0x2, 0x3, 0x4
GI_1_SLICE_REV1, GI_1_SLICE_REV2 = 0x7, 0x9  # 1g with media engines; 1g with two memory slices
GI_PROFILE_COUNT = 0x12
CI_PROFILE_BY_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4}
CI_PROFILE_COUNT = 0x9

# /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then for each GPU minor N and
# GI id G (0..14): gpuN/giG/access, then gpuN/giG/ci0..ci7/access, in that order.
CAP_CONFIG_MINOR = 1
CAP_MONITOR_MINOR = 2
_CAPS_FIRST_GI = 3
_CAPS_PER_GI = 1 + MAX_CI_PER_GI
_CAPS_PER_GPU = (MAX_GI_ID + 1) * _CAPS_PER_GI


@dataclass(frozen=True, order=True)
class Placement:
    """Where an instance sits: ``size`` slices from ``start`` (memory slices for a GI,
    compute slices within its GI for a CI)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.size}"


@dataclass(frozen=True)
class GpuInstanceProfile:
    """One row of ``nvidia-smi mig -lgip`` (``nvmlGpuInstanceProfileInfo_v2_t``)."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int  # the profile id
    name: str  # "1g.10gb", "1g.10gb+me"
    slices: int  # compute slices (sliceCount)
    memory_slices: int
    memory_mib: int  # memorySizeMB
    sm_count: int  # multiprocessorCount
    instance_count: int  # how many may exist at once
    placements: tuple[Placement, ...]
    copy_engines: int
    media: bool = False  # a "+me" profile: the GPU's media engines

    @property
    def nvml_name(self) -> str:
        return f"MIG {self.name}"


@dataclass(frozen=True)
class ComputeInstanceProfile:
    """One row of ``nvidia-smi mig -lcip`` for a GI of some profile."""

    index: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (also its id)
    name: str  # "1c.3g.40gb", or the GI's name when it takes every compute slice
    slices: int
    instance_count: int
    sm_count: int
    placements: tuple[Placement, ...]  # compute slices within the GI


@dataclass(frozen=True)
class MigProduct:
    """One MIG-capable product: its GPU instance profiles."""

    key: str  # "H100-80GB"
    sm_count: int  # SMs of the whole GPU out of MIG mode (throughput reference)
    profiles: tuple[GpuInstanceProfile, ...]

    def by_index(self, index: int) -> GpuInstanceProfile | None:
        return next((p for p in self.profiles if p.index == index), None)

    def by_id(self, profile_id: int) -> GpuInstanceProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def by_name(self, name: str) -> GpuInstanceProfile | None:
        wanted = name.strip().removeprefix("MIG ").lower()
        return next((p for p in self.profiles if p.name == wanted), None)


def _starts(starts: Iterable[int], size: int) -> tuple[Placement, ...]:
    return tuple(Placement(s, size) for s in starts)


_ONE = _starts(range(7), 1)  # {0,1,2,3,4,5,6}:1
_ONE_WIDE = _starts((0, 2, 4, 6), 2)  # {0,2,4,6}:2 (a 1g profile with two memory slices)
_TWO = _starts((0, 2, 4), 2)  # {0,2,4}:2
_THREE = _starts((0, 4), 4)  # {0,4}:4
_FOUR = _starts((0,), 4)  # {0}:4
_SEVEN = _starts((0,), 8)  # {0}:8


def _product(key: str, sm_count: int, mib: Sequence[int], sms: Sequence[int], ce7: int) -> MigProduct:
    """The seven profiles every product here has, in nvidia-smi's order: 1g, 1g+me, 1g with
    two memory slices, 2g, 3g, 4g, 7g; ``mib`` and ``sms`` in that order. A profile's name
    is its compute slices and its share of the product's memory in GB, rounded half up
    (``<g>g.<gb>gb``, ``+me`` with the media engines: 1g.18gb, 1g.35gb, 3g.71gb of 141 GB)."""
    total_gb = int(key.rpartition("-")[2].removesuffix("GB"))
    rows = (
        (GI_1_SLICE, 19, 1, 1, 7, _ONE, 1, False),
        (GI_1_SLICE_REV1, 20, 1, 1, 1, _ONE, 1, True),
        (GI_1_SLICE_REV2, 15, 1, 2, 4, _ONE_WIDE, 1, False),
        (GI_2_SLICE, 14, 2, 2, 3, _TWO, 2, False),
        (GI_3_SLICE, 9, 3, 4, 2, _THREE, 3, False),
        (GI_4_SLICE, 5, 4, 4, 1, _FOUR, 4, False),
        (GI_7_SLICE, 0, 7, 8, 1, _SEVEN, ce7, False),
    )
    profiles = tuple(
        GpuInstanceProfile(
            index,
            pid,
            _name(slices, total_gb * memory, media),
            slices,
            memory,
            size,
            sm,
            count,
            places,
            ce,
            media,
        )
        for (index, pid, slices, memory, count, places, ce, media), size, sm in zip(
            rows, mib, sms, strict=True
        )
    )
    return MigProduct(key, sm_count, profiles)


def _name(slices: int, memory_gb_eighths: int, media: bool) -> str:
    gb = (2 * memory_gb_eighths + MEMORY_SLICES) // (2 * MEMORY_SLICES)  # x/8 rounded half up
    return f"{slices}g.{gb}gb" + ("+me" if media else "")


_A100_SMS = (14, 14, 14, 28, 42, 56, 98)
_HOPPER_SMS = (16, 16, 26, 32, 60, 64, 132)
# Memory (MiB) and SMs of each profile, in _product's order; the copy engines of the 7g profile.
PRODUCTS: tuple[MigProduct, ...] = (
    _product("A100-40GB", 108, (4864, 4864, 9984, 9984, 20096, 20096, 40448), _A100_SMS, 7),
    _product("A100-80GB", 108, (9728, 9728, 19968, 19968, 40192, 40192, 80896), _A100_SMS, 7),
    _product("H100-80GB", 132, (9984, 9984, 20096, 20096, 40448, 40448, 81152), _HOPPER_SMS, 8),
    _product("H200-141GB", 132, (16384, 16384, 33280, 33280, 66560, 66560, 143360), _HOPPER_SMS, 8),
)


def product(key: str) -> MigProduct | None:
    """The MIG product ``A100-40GB``, ``H100-80GB``...; None when the GPU has no MIG."""
    wanted = key.strip().upper()
    return next((p for p in PRODUCTS if p.key == wanted), None)


def product_for(model: str, memory_mib: int) -> MigProduct | None:
    """The MIG product of a GPU as NVML names it ("NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-40GB", "NVIDIA H200") with its memory: the product of that family whose memory
    is within 10 % of the GPU's; None for a GPU without MIG or of a variant not tabled here
    (an H100 NVL's 94 GB)."""
    name = model.upper()
    for p in PRODUCTS:
        family, _, size = p.key.partition("-")
        nominal_mib = int(size.removesuffix("GB")) * 1024
        if family in name and abs(memory_mib - nominal_mib) <= nominal_mib // 10:
            return p
    return None


# Compute instances ------------------------------------------------------------------------
def ci_profiles(gi: GpuInstanceProfile, gpu: MigProduct) -> tuple[ComputeInstanceProfile, ...]:
    """The compute instance profiles of a GI: every CI size up to the GI's, with its
    placements on the GI's compute slices (1c anywhere, 2c on even slots, 3c at 0 or 4)."""
    profiles = []
    for slices, index in CI_PROFILE_BY_SLICES.items():
        if slices > gi.slices:
            continue
        align = {1: 1, 2: 2, 3: 4}.get(slices, MEMORY_SLICES)
        places = tuple(Placement(s, slices) for s in range(0, gi.slices, align) if s + slices <= gi.slices)
        full = slices == gi.slices
        name = gi.name if full else f"{slices}c.{gi.name}"
        sms = gi.sm_count if full else min(gi.sm_count, _sm_of(gpu, slices))
        profiles.append(ComputeInstanceProfile(index, name, slices, len(places), sms, places))
    return tuple(profiles)


def _sm_of(gpu: MigProduct, slices: int) -> int:
    """SMs of ``slices`` compute slices: the plain GI profile of that many slices."""
    plain = [p for p in gpu.profiles if p.slices == slices and not p.media]
    return min(p.sm_count for p in plain) if plain else slices * gpu.sm_count // COMPUTE_SLICES


def full_ci_profile(gi: GpuInstanceProfile, gpu: MigProduct) -> ComputeInstanceProfile:
    """The CI that takes the whole GI (what ``nvidia-smi mig -cgi ... -C`` creates)."""
    return next(c for c in ci_profiles(gi, gpu) if c.slices == gi.slices)


# Placement --------------------------------------------------------------------------------
def free_placements(gi: GpuInstanceProfile, taken: Iterable[Placement]) -> list[Placement]:
    """The profile's placements that overlap no placement in ``taken``."""
    used = list(taken)
    return [p for p in gi.placements if not any(p.overlaps(t) for t in used)]


def remaining_capacity(
    gi: GpuInstanceProfile, existing: Sequence[tuple[GpuInstanceProfile, Placement]]
) -> int:
    """``nvmlDeviceGetGpuInstanceRemainingCapacity``: how many more GIs of the profile fit
    beside ``existing`` (a profile's own placements never overlap one another)."""
    same = sum(1 for profile, _ in existing if profile.id == gi.id)
    free = len(free_placements(gi, (placement for _, placement in existing)))
    return max(0, min(gi.instance_count - same, free))


def choose_placement(
    gpu: MigProduct, gi: GpuInstanceProfile, existing: Sequence[tuple[GpuInstanceProfile, Placement]]
) -> Placement | None:
    """Where a GI created without a placement goes (``nvmlDeviceCreateGpuInstance``): the first
    of :func:`placements_by_preference`; None when none is free. NVIDIA does not document
    the driver's choice; this rule reproduces the user guide's examples (a first 2g at 4:2,
    a first 1g at 6:1, a first 3g at 4:4)."""
    if remaining_capacity(gi, existing) == 0:
        return None
    return next(iter(placements_by_preference(gpu, gi, existing)), None)


def placements_by_preference(
    gpu: MigProduct, gi: GpuInstanceProfile, existing: Sequence[tuple[GpuInstanceProfile, Placement]]
) -> list[Placement]:
    """The profile's free placements, those that leave the most room for the GPU's other
    plain profiles first (capacity left, weighted by memory slices), then by start."""

    def room(place: Placement) -> int:
        after = [*existing, (gi, place)]
        return sum(remaining_capacity(p, after) * p.memory_slices for p in gpu.profiles if not p.media)

    return sorted(free_placements(gi, (p for _, p in existing)), key=lambda p: (-room(p), p.start))


def gpu_instance_id(place: Placement, used: Iterable[int]) -> int | None:
    """The id the simulated driver gives a GI at ``place``: 0 for the whole GPU, 1 or 2 (the
    lower free one) for a half, 3 + start/2 for a quarter, 7 + start for an eighth, as the
    user guide's listings show; the real driver picks ids itself (never derive a placement
    from an id). None when the id is taken."""
    taken = set(used)
    if place.size >= MEMORY_SLICES:
        candidates = [0]
    elif place.size >= 4:
        candidates = [1, 2]
    elif place.size >= 2:
        candidates = [3 + place.start // 2]
    else:
        candidates = [7 + place.start]
    return next((c for c in candidates if c not in taken), None)


# Device nodes -----------------------------------------------------------------------------
def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    """The ``nvidia-caps`` minor of ``gpu<N>/gi<G>/access``."""
    _check_ids(gpu_minor, gi_id, 0)
    return _CAPS_FIRST_GI + gpu_minor * _CAPS_PER_GPU + gi_id * _CAPS_PER_GI


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """The ``nvidia-caps`` minor of ``gpu<N>/gi<G>/ci<C>/access``."""
    _check_ids(gpu_minor, gi_id, ci_id)
    return gi_cap_minor(gpu_minor, gi_id) + 1 + ci_id


def cap_device(minor: int) -> str:
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


def mig_minors(gpu_minors: Iterable[int]) -> str:
    """The content of ``/proc/driver/nvidia-caps/mig-minors`` for GPUs of these minors."""
    lines = [f"config {CAP_CONFIG_MINOR}", f"monitor {CAP_MONITOR_MINOR}"]
    for n in sorted(gpu_minors):
        for g in range(MAX_GI_ID + 1):
            lines.append(f"gpu{n}/gi{g}/access {gi_cap_minor(n, g)}")
            lines += [f"gpu{n}/gi{g}/ci{c}/access {ci_cap_minor(n, g, c)}" for c in range(MAX_CI_PER_GI)]
    return "\n".join(lines) + "\n"


def _check_ids(gpu_minor: int, gi_id: int, ci_id: int) -> None:
    if gpu_minor < 0 or not 0 <= gi_id <= MAX_GI_ID or not 0 <= ci_id < MAX_CI_PER_GI:
        raise ValueError(
            f"no MIG capability for GPU minor {gpu_minor}, GI {gi_id}, CI {ci_id} "
            f"(GI ids are 0..{MAX_GI_ID}, CI ids 0..{MAX_CI_PER_GI - 1})"
        )
