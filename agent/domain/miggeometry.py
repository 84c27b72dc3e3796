"""A MIG geometry (the GPU instances a GPU should have, by profile name, each with one
compute instance over all of its slices) checked against a product's profiles and
placements, and the placements to create it at.

Checked before the GPU is touched: every name must be one of the product's profiles, and
all the instances must fit together on the GPU's memory slices. The plan places them
explicitly (``nvmlDeviceCreateGpuInstanceWithPlacement``), so the order they are listed in
does not matter: the search tries, for each instance in turn, the placements that leave
the most room for the rest first (``migprofiles.placements_by_preference``) and backtracks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import MigGeometryError
from agent.platform.gpu.migprofiles import (
    COMPUTE_SLICES,
    MEMORY_SLICES,
    PRODUCTS,
    ComputeInstanceProfile,
    GpuInstanceProfile,
    MigProduct,
    Placement,
    full_ci_profile,
    placements_by_preference,
    remaining_capacity,
)


@dataclass(frozen=True)
class PlannedInstance:
    """One GPU instance of a geometry, where it goes, and its whole compute instance."""

    profile: GpuInstanceProfile
    placement: Placement
    ci: ComputeInstanceProfile


def known_profile_names() -> frozenset[str]:
    """Every profile name of every MIG product the agent knows."""
    return frozenset(p.name for product in PRODUCTS for p in product.profiles)


def plan_geometry(gpu: MigProduct, names: Sequence[str]) -> tuple[PlannedInstance, ...]:
    """The instances of ``names`` on a ``gpu`` and their placements; MigGeometryError saying
    why when a name is not one of its profiles or they do not fit together."""
    profiles = []
    for name in names:
        found = gpu.by_name(name)
        if found is None:
            offered = ", ".join(p.name for p in gpu.profiles)
            raise MigGeometryError(f"a {gpu.key} has no MIG profile {name!r} (its profiles: {offered})")
        profiles.append(found)
    why = _over_count(profiles)
    # Largest first; the search never revisits a set of taken placements that failed before.
    order = sorted(range(len(profiles)), key=lambda i: (-profiles[i].memory_slices, i))
    placements = None if why else _place(gpu, [profiles[i] for i in order], [], set())
    if placements is None:
        why = why or _overlap(profiles)
        raise MigGeometryError(f"{', '.join(names)} do not fit on a {gpu.key}: {why}")
    placed = dict(zip(order, placements, strict=True))
    return tuple(PlannedInstance(p, placed[i], full_ci_profile(p, gpu)) for i, p in enumerate(profiles))


def fits_some_product(names: Sequence[str]) -> str | None:
    """Why no known MIG product can take ``names`` together (None: one can), for checking a
    node config before the GPU it is meant for is known."""
    candidates = [g for g in PRODUCTS if all(g.by_name(n) is not None for n in names)]
    if not candidates:
        return "no MIG GPU has all of these profiles"
    reasons = []
    for gpu in candidates:
        try:
            plan_geometry(gpu, names)
        except MigGeometryError as err:
            reasons.append(str(err))
            continue
        return None
    return "; ".join(reasons)


def _place(
    gpu: MigProduct,
    todo: Sequence[GpuInstanceProfile],
    existing: list[tuple[GpuInstanceProfile, Placement]],
    failed: set[frozenset[tuple[int, Placement]]],
) -> list[Placement] | None:
    if not todo:
        return []
    taken = frozenset((p.id, place) for p, place in existing)
    if taken in failed:
        return None
    first, rest = todo[0], todo[1:]
    if remaining_capacity(first, existing) > 0:
        for place in placements_by_preference(gpu, first, existing):
            found = _place(gpu, rest, [*existing, (first, place)], failed)
            if found is not None:
                return [place, *found]
    failed.add(taken)
    return None


def _over_count(profiles: Sequence[GpuInstanceProfile]) -> str:
    """Why the instances cannot fit whatever their placements ("": they might)."""
    for p in {p.id: p for p in profiles}.values():
        wanted = sum(1 for q in profiles if q.id == p.id)
        if wanted > p.instance_count:
            return f"at most {p.instance_count} {p.name} on one GPU, {wanted} asked"
    compute = sum(p.slices for p in profiles)
    if compute > COMPUTE_SLICES:
        return f"they need {compute} compute slices, a GPU has {COMPUTE_SLICES}"
    memory = sum(p.memory_slices for p in profiles)
    if memory > MEMORY_SLICES:
        return f"they need {memory} memory slices, a GPU has {MEMORY_SLICES}"
    return ""


def _overlap(profiles: Sequence[GpuInstanceProfile]) -> str:
    where = "; ".join(
        f"{p.name} at {', '.join(map(str, p.placements))}" for p in {p.id: p for p in profiles}.values()
    )
    return f"their placements overlap ({where}, as start:size on the {MEMORY_SLICES} memory slices)"
