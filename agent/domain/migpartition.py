"""Dynamic MIG as DRA partitionable devices (KEP-4815, ``resource.k8s.io/v1``).

A GPU on dynamic MIG (node config ``mig.dynamic``) is published as

- one **counter set**, ``gpu-<index>-counters``, in a ResourceSlice of its own (a slice holds
  either devices or shared counters): a counter ``memory-slice-<k>`` of value 1 for each of
  the GPU's 8 memory slices, and ``compute-slices`` of value 7. Memory slices are single
  counters because placements conflict by *which* slices they cover (``3g.40gb`` at 0 and
  ``4g.40gb`` at 0 overlap; at 0 and 4 they do not); compute slices only add up.
- one **device per profile placement**, ``gpu-<index>-mig-<profile>-<start>``, that a claim
  takes whole, consuming the memory slices its placement covers (1 each) and its compute
  slices. The scheduler never allocates two devices whose counters add up past the set, so
  the claims' placements never overlap and never need more than 7 compute slices: exactly
  what the driver lets exist together (a profile's own placements never overlap, so its
  instance count follows from them).
- its **share device** ``gpu-<index>`` (cores and memory, as on every DRA GPU) carrying the
  attribute ``isolation: "mig"`` and consuming the *whole* counter set: the scheduler gives
  the GPU either to placement claims or to shares (each share served by a MIG instance made
  for it, agent/control/dramig.py), never to both at once. Counters of a device that many
  claims share are consumed once, by its first allocation.

``+me`` profiles are not published: they hold the GPU's only media engines (and the agent
never picks them for a share either, agent/domain/migfit.py). Pure functions over the
profile tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.domain.dra import ISOLATION_MIG, mig_device_name, mig_slot, profile_token
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migprofiles import (
    COMPUTE_SLICES,
    MEMORY_SLICES,
    GpuInstanceProfile,
    MigProduct,
    Placement,
    placements_by_preference,
)

MIG_DEVICE_TYPE = "mig"
COMPUTE_COUNTER = "compute-slices"
MAX_COUNTER_DEVICES = 64  # devices in one slice when any of them consumes counters


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counters"


def memory_counter(slot: int) -> str:
    return f"memory-slice-{slot}"


def counter_set(index: int) -> dict[str, Any]:
    """The GPU's CounterSet (``spec.sharedCounters[]``)."""
    counters = {memory_counter(k): {"value": "1"} for k in range(MEMORY_SLICES)}
    counters[COMPUTE_COUNTER] = {"value": str(COMPUTE_SLICES)}
    return {"name": counter_set_name(index), "counters": counters}


def consumption(index: int, placement: Placement, compute: int) -> list[dict[str, Any]]:
    """``consumesCounters`` of a device covering ``placement`` with ``compute`` slices."""
    counters = {memory_counter(k): {"value": "1"} for k in range(placement.start, placement.end)}
    counters[COMPUTE_COUNTER] = {"value": str(compute)}
    return [{"counterSet": counter_set_name(index), "counters": counters}]


def whole_gpu_consumption(index: int) -> list[dict[str, Any]]:
    return consumption(index, Placement(0, MEMORY_SLICES), COMPUTE_SLICES)


def published_profiles(product: MigProduct) -> list[GpuInstanceProfile]:
    """The profiles published as devices: the plain ones, smallest first."""
    return sorted(
        (p for p in product.profiles if not p.media), key=lambda p: (p.slices, p.memory_slices, p.index)
    )


def placement_device(
    gpu: GpuInfo, product: MigProduct, profile: GpuInstanceProfile, placement: Placement, driver: str = ""
) -> dict[str, Any]:
    """One device: ``profile`` at ``placement`` of ``gpu`` (``driver``: its semver, if known)."""
    attributes: dict[str, Any] = {
        "type": {"string": MIG_DEVICE_TYPE},
        "profile": {"string": profile.name},
        "parentUUID": {"string": gpu.uuid[:64]},
        "parentIndex": {"int": gpu.index},
        "productName": {"string": gpu.model[:64]},
        "placementStart": {"int": placement.start},
        "placementSize": {"int": placement.size},
        "computeSlices": {"int": profile.slices},
        "memorySlices": {"int": profile.memory_slices},
    }
    if driver:
        attributes["driverVersion"] = {"version": driver}
    return {
        "name": mig_device_name(gpu.index, profile.name, placement.start),
        "attributes": attributes,
        "capacity": {
            "memory": {"value": f"{profile.memory_mib}Mi"},
            "multiprocessors": {"value": str(profile.sm_count)},
        },
        "consumesCounters": consumption(gpu.index, placement, profile.slices),
    }


def placement_devices(gpu: GpuInfo, product: MigProduct, driver: str = "") -> list[dict[str, Any]]:
    """Every published profile at each of its placements, the placement that leaves the most
    room for the others first (the scheduler takes the first that fits)."""
    return [
        placement_device(gpu, product, profile, place, driver)
        for profile in published_profiles(product)
        for place in placements_by_preference(product, profile, [])
    ]


def isolated_share_device(share_device: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A dynamic GPU's share device: the plain one, marked ``isolation: mig`` and consuming
    the GPU's whole counter set."""
    device = dict(share_device)
    device["attributes"] = {**share_device["attributes"], "isolation": {"string": ISOLATION_MIG}}
    device["consumesCounters"] = whole_gpu_consumption(index)
    return device


def slot_of(product: MigProduct, device: str) -> tuple[GpuInstanceProfile, Placement] | None:
    """The profile and placement a placement device's name stands for; None when ``device``
    is not one, or names a profile or placement ``product`` does not have."""
    slot = mig_slot(device)
    if slot is None:
        return None
    token, start = slot
    for profile in published_profiles(product):
        if profile_token(profile.name) != token:
            continue
        for place in profile.placements:
            if place.start == start:
                return profile, place
    return None


def chunks(devices: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The devices in slices of at most MAX_COUNTER_DEVICES when any consumes counters (the
    API's limit), all in one otherwise; always at least one (possibly empty) slice."""
    if not any("consumesCounters" in d for d in devices):
        return [list(devices)]
    return [
        list(devices[i : i + MAX_COUNTER_DEVICES]) for i in range(0, len(devices), MAX_COUNTER_DEVICES)
    ] or [[]]
