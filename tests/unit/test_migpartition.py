"""Dynamic MIG as partitionable devices: the counter sets, the placement devices, the pool's
slices, and the emulated scheduler never allocating two placements that overlap."""

from __future__ import annotations

from typing import Any

import pytest

from agent.domain.dra import DRIVER, mig_device_name, mig_slot
from agent.domain.draslice import build_slice, desired_counters, desired_devices, pool_contents
from agent.domain.migpartition import (
    MAX_COUNTER_DEVICES,
    counter_set,
    placement_devices,
    slot_of,
)
from agent.emulators.draallocator import DraAllocationError, allocate_claim
from agent.platform.gpu.migprofiles import Placement, product_for
from tests.integration.deploy_render import validate
from tests.unit.drafixtures import GPUS, NODE

H100 = product_for(GPUS[0].model, GPUS[0].memory_mib)
CLASS = {"vcuda-gpu": {"spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}}


def test_the_counter_set_has_eight_memory_slices_and_seven_compute_slices() -> None:
    assert counter_set(0) == {
        "name": "gpu-0-counters",
        "counters": {
            **{f"memory-slice-{k}": {"value": "1"} for k in range(8)},
            "compute-slices": {"value": "7"},
        },
    }


def test_each_plain_profile_is_published_at_each_placement() -> None:
    assert H100 is not None
    devices = {d["name"]: d for d in placement_devices(GPUS[0], H100, "550.54.15")}
    # 1g.10gb x7, 1g.20gb x4, 2g.20gb x3, 3g.40gb x2, 4g.40gb, 7g.80gb; no +me profile.
    assert len(devices) == 7 + 4 + 3 + 2 + 1 + 1
    three = devices["gpu-0-mig-3g40gb-4"]
    assert three["attributes"] == {
        "type": {"string": "mig"},
        "profile": {"string": "3g.40gb"},
        "parentUUID": {"string": GPUS[0].uuid},
        "parentIndex": {"int": 0},
        "productName": {"string": GPUS[0].model},
        "placementStart": {"int": 4},
        "placementSize": {"int": 4},
        "computeSlices": {"int": 3},
        "memorySlices": {"int": 4},
        "driverVersion": {"version": "550.54.15"},
    }
    assert three["capacity"] == {"memory": {"value": "40448Mi"}, "multiprocessors": {"value": "60"}}
    assert three["consumesCounters"] == [
        {
            "counterSet": "gpu-0-counters",
            "counters": {
                **{f"memory-slice-{k}": {"value": "1"} for k in (4, 5, 6, 7)},
                "compute-slices": {"value": "3"},
            },
        }
    ]
    assert not any("allowMultipleAllocations" in d for d in devices.values())  # taken whole


def test_a_device_name_maps_back_to_its_profile_and_placement() -> None:
    assert H100 is not None
    name = mig_device_name(0, "1g.10gb", 6)
    assert (name, mig_slot(name)) == ("gpu-0-mig-1g10gb-6", ("1g10gb", 6))
    profile, place = slot_of(H100, name) or (None, None)
    assert profile is not None and (profile.name, place) == ("1g.10gb", Placement(6, 1))
    assert slot_of(H100, "gpu-0-mig-3g40gb-2") is None  # 3g.40gb has no placement at 2
    assert slot_of(H100, "gpu-0-mig-1g18gb-0") is None  # an H200 profile
    assert slot_of(H100, "gpu-0") is None


def test_a_dynamic_gpu_gets_counters_placements_and_an_isolated_share_device() -> None:
    assert H100 is not None
    devices = desired_devices(GPUS, {}, 0.9, "550.54.15", {1: H100})
    assert [d["name"] for d in devices[:2]] == ["gpu-0", "gpu-1"]
    assert "consumesCounters" not in devices[0] and "isolation" not in devices[0]["attributes"]
    share = devices[1]
    assert share["attributes"]["isolation"] == {"string": "mig"}
    assert share["allowMultipleAllocations"] is True
    [consumed] = share["consumesCounters"]  # the whole GPU: placements and shares exclude each other
    assert consumed["counters"]["compute-slices"] == {"value": "7"} and len(consumed["counters"]) == 9
    assert all(d["name"].startswith("gpu-1-mig-") for d in devices[2:])
    assert desired_counters(devices) == [counter_set(1)]
    # An unhealthy dynamic GPU publishes neither its devices nor its counters.
    gone = desired_devices(GPUS, {1: False}, 0.9, None, {1: H100})
    assert [d["name"] for d in gone] == ["gpu-0"] and desired_counters(gone) == []


def test_the_pool_splits_into_slices_of_at_most_64_devices_and_one_per_counter_set() -> None:
    assert H100 is not None
    gpus = [GPUS[0].__class__(i, f"GPU-{i}", GPUS[0].model, GPUS[0].memory_mib, i, "", 0) for i in range(8)]
    devices = desired_devices(gpus, {}, 1.0, None, dict.fromkeys(range(8), H100))
    assert len(devices) == 8 * 19
    slices = pool_contents(NODE, devices, desired_counters(devices))
    names = [s.name for s in slices]
    assert names[:3] == [f"{NODE}-gpu.vcuda.io", f"{NODE}-gpu.vcuda.io-2", f"{NODE}-gpu.vcuda.io-3"]
    assert names[3:] == [f"{NODE}-gpu.vcuda.io-gpu-{i}-counters" for i in range(8)]
    assert all(len(s.devices) <= MAX_COUNTER_DEVICES for s in slices)
    assert sum(len(s.devices) for s in slices) == len(devices)
    counters = build_slice(NODE, (), 3, content=slices[3], count=len(slices))
    assert "devices" not in counters["spec"]  # only one of devices and sharedCounters
    assert counters["spec"]["sharedCounters"] == [counter_set(0)]
    assert counters["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 11}
    # Without dynamic MIG the pool is the one slice it always was.
    assert [s.name for s in pool_contents(NODE, desired_devices(GPUS, {}, 1.0))] == [f"{NODE}-gpu.vcuda.io"]


def test_the_published_slices_are_valid_136_objects() -> None:
    assert H100 is not None
    devices = desired_devices(GPUS, {}, 0.9, "550.54.15", {0: H100})
    slices = pool_contents(NODE, devices, desired_counters(devices))
    for content in slices:
        validate(build_slice(NODE, (), 1, content=content, count=len(slices), node_uid="u-1"))


# The emulated scheduler -------------------------------------------------------------------
def _slices() -> list[dict[str, Any]]:
    assert H100 is not None
    devices = desired_devices(GPUS[:1], {}, 1.0, None, {0: H100})
    contents = pool_contents(NODE, devices, desired_counters(devices))
    return [build_slice(NODE, (), 1, content=c, count=len(contents)) for c in contents]


def _claim(name: str, selector: str = "", capacity: dict[str, str] | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "vcuda-gpu"}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {
        "metadata": {"namespace": "default", "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def _profile(name: str) -> str:
    return f"device.attributes['{DRIVER}'].profile == '{name}'"


def _allocate(claim: dict[str, Any], allocated: list[dict[str, Any]]) -> str:
    allocation = allocate_claim(claim, CLASS, _slices(), allocated, NODE)
    allocated.append({**claim, "status": {"allocation": allocation}})
    [result] = allocation["devices"]["results"]
    return str(result["device"])


def test_two_claims_get_placements_that_do_not_overlap() -> None:
    allocated: list[dict[str, Any]] = []
    first = _allocate(_claim("a", _profile("3g.40gb")), allocated)
    second = _allocate(_claim("b", _profile("3g.40gb")), allocated)
    assert {first, second} == {"gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"}
    with pytest.raises(
        DraAllocationError, match=r"counter gpu-0-counters/memory-slice-\d: 1 consumed \+ 1 > 1"
    ):
        _allocate(_claim("c", _profile("1g.10gb")), allocated)


def test_seven_1g_instances_fill_the_gpu() -> None:
    allocated: list[dict[str, Any]] = []
    names = [_allocate(_claim(f"one-{i}", _profile("1g.10gb")), allocated) for i in range(7)]
    assert sorted(slot[1] for n in names if (slot := mig_slot(n))) == list(range(7))
    with pytest.raises(DraAllocationError, match="memory-slice-6: 1 consumed"):
        _allocate(_claim("eighth", _profile("1g.20gb")), allocated)  # 6:2 is the one left


def test_counters_that_add_up_are_bounded_by_the_set() -> None:
    """The compute-slices count, with a set of 3 so that it is what refuses."""
    slices = _slices()
    for s in slices:
        for counter_set_ in s["spec"].get("sharedCounters") or []:
            counter_set_["counters"]["compute-slices"]["value"] = "3"
    allocated: list[dict[str, Any]] = []
    for claim in (_claim("a", _profile("3g.40gb")), _claim("b", _profile("1g.10gb"))):
        try:
            allocation = allocate_claim(claim, CLASS, slices, allocated, NODE)
        except DraAllocationError as err:
            assert "compute-slices: 3 consumed + 1 > 3" in str(err)
            break
        allocated.append({**claim, "status": {"allocation": allocation}})
    else:
        raise AssertionError("a 1g beside a 3g was allocated with only 3 compute slices")


def test_a_share_and_a_placement_on_one_gpu_exclude_each_other() -> None:
    allocated: list[dict[str, Any]] = []
    share = _claim("share", capacity={"cores": "20", "memory": "4Gi"})
    assert _allocate(share, allocated) == "gpu-0"
    assert _allocate(_claim("share-2", capacity={"cores": "20"}), allocated) == "gpu-0"  # counted once
    with pytest.raises(DraAllocationError, match="counter gpu-0-counters"):
        _allocate(_claim("mig", _profile("1g.10gb")), allocated)
    allocated.clear()
    _allocate(_claim("mig", _profile("1g.10gb")), allocated)
    with pytest.raises(DraAllocationError, match="counter gpu-0-counters"):
        _allocate(_claim("share", capacity={"cores": "20"}), allocated)


def test_a_device_consuming_an_unpublished_counter_set_is_never_allocated() -> None:
    slices = [s for s in _slices() if "sharedCounters" not in s["spec"]]
    for s in slices:
        s["spec"]["pool"]["resourceSliceCount"] = len(slices)
    with pytest.raises(DraAllocationError, match="which the pool does not publish"):
        allocate_claim(_claim("a", _profile("7g.80gb")), CLASS, slices, [], NODE)
