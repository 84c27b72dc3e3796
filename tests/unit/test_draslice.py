"""agent/domain/draslice.py: the ResourceSlice the node publishes, and agent/control/drapublisher.py's
generation rule (in-memory slices here; over HTTP in tests/integration/test_dra_publication.py)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pytest

from agent.control.drapublisher import SlicePublisher
from agent.domain.dra import DRIVER
from agent.domain.draslice import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    build_slice,
    desired_devices,
    is_current,
    pci_bus_id,
    pool_generation,
    semantic_version,
    slice_name,
)
from agent.domain.health import HealthBoard
from agent.errors import ConflictError, KubeError
from tests.unit.drafixtures import GPUS, H100_MIB, NODE, node_slice

Doc = dict[str, Any]


def test_one_shareable_device_per_gpu_with_cores_and_memory() -> None:
    obj = build_slice(NODE, desired_devices(GPUS, {}, 0.9, "535.104.05"), 3)
    assert obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceSlice"
    assert obj["metadata"]["name"] == f"{NODE}-gpu.vcuda.io"
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRIVER, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    gpu1 = spec["devices"][1]
    assert gpu1["allowMultipleAllocations"] is True
    assert gpu1["attributes"] == {
        "type": {"string": "gpu"},
        "uuid": {"string": GPUS[1].uuid},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "index": {"int": 1},
        "minor": {"int": 1},
        "driverVersion": {"version": "535.104.5"},
        PCI_BUS_ID_ATTRIBUTE: {"string": "0000:3b:00.0"},
        NUMA_NODE_ATTRIBUTE: {"int": 1},
    }
    assert gpu1["capacity"] == {
        "cores": {
            "value": "100",
            "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
        },
        "memory": {
            "value": f"{int(H100_MIB * 0.9)}Mi",  # 73403Mi: memory x deviceMemoryScaling, whole MiB
            "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1Mi"}},
        },
    }


def test_unhealthy_gpus_leave_the_slice() -> None:
    devices = desired_devices(GPUS, {0: False, 1: True}, 1.0)
    assert [d["name"] for d in devices] == ["gpu-1"]
    assert desired_devices(GPUS, {0: False, 1: False}, 1.0) == []
    assert [d["name"] for d in desired_devices(GPUS, {}, 1.0)] == ["gpu-0", "gpu-1"], "unknown = healthy"


def test_unknown_facts_are_left_out_not_guessed() -> None:
    odd = dataclasses.replace(GPUS[0], numa_node=None, pci_bus_id="weird")
    [device] = desired_devices([odd], {}, 1.0, driver_version="r550-beta")
    assert {"driverVersion", PCI_BUS_ID_ATTRIBUTE, NUMA_NODE_ATTRIBUTE}.isdisjoint(device["attributes"])
    no_affinity = dataclasses.replace(GPUS[0], numa_node=-1)
    assert NUMA_NODE_ATTRIBUTE not in desired_devices([no_affinity], {}, 1.0)[0]["attributes"]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:af:1f.7", "0000:af:1f.7"), ("3B:00.0", None), ("", None)],
)
def test_pci_bus_ids_are_the_standard_attributes_form(given: str, expected: str | None) -> None:
    assert pci_bus_id(given) == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"), ("550.54", "550.54.0"), ("575.x", None)],
)
def test_driver_versions_become_semver(given: str, expected: str | None) -> None:
    assert semantic_version(given) == expected


def test_a_very_long_node_name_still_gives_a_valid_unique_name() -> None:
    long_a, long_b = "a" * 250, "a" * 249 + "b"
    assert len(slice_name(long_a)) <= 253 and slice_name(long_a).endswith("-gpu.vcuda.io")
    assert slice_name(long_a) != slice_name(long_b)


def test_is_current_ignores_the_generation_but_not_the_devices() -> None:
    devices = desired_devices(GPUS, {}, 1.0)
    stored = build_slice(NODE, devices, 7)
    assert is_current(stored, NODE, devices) and pool_generation(stored) == 7
    assert not is_current(stored, NODE, devices[:1])
    assert not is_current(build_slice("other-node", devices, 7), NODE, devices)


class FakeSlices:
    """An in-memory ResourceSliceClient: resourceVersion preconditions, 409 and 404 like the API."""

    def __init__(self) -> None:
        self.objects: dict[str, Doc] = {}
        self.writes: list[tuple[str, Doc]] = []
        self.fail: KubeError | None = None
        self._rv = 0

    def list(self) -> list[Doc]:
        if self.fail:
            raise self.fail
        return [dict(o) for o in self.objects.values()]

    def _store(self, obj: Doc) -> Doc:
        self._rv += 1
        stored = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
        self.objects[obj["metadata"]["name"]] = stored
        return stored

    def create(self, obj: Doc) -> Doc:
        if obj["metadata"]["name"] in self.objects:
            raise ConflictError("exists", status=409)
        self.writes.append(("create", obj))
        return self._store(obj)

    def replace(self, obj: Doc) -> Doc:
        name = obj["metadata"]["name"]
        if self.objects[name]["metadata"]["resourceVersion"] != obj["metadata"].get("resourceVersion"):
            raise ConflictError("changed", status=409)
        self.writes.append(("replace", obj))
        return self._store(obj)

    def delete(self, name: str, resource_version: str | None = None) -> bool:
        return self.objects.pop(name, None) is not None


def publisher(slices: FakeSlices, board: HealthBoard, scaling: list[float] | None = None) -> SlicePublisher:
    values = scaling or [1.0]
    return SlicePublisher(
        slices,  # type: ignore[arg-type]  # the in-memory stand-in has the same methods
        GPUS,
        board,
        scaling=lambda: values[0],
        node_name=NODE,
    )


def generation(slices: FakeSlices) -> int:
    return pool_generation(slices.objects[slice_name(NODE)])


def test_the_pool_generation_goes_up_on_every_content_change_and_only_then() -> None:
    slices, board = FakeSlices(), HealthBoard(g.index for g in GPUS)
    scaling = [1.0]
    pub = publisher(slices, board, scaling)
    assert pub.sync() and generation(slices) == 1 and [w for w, _ in slices.writes] == ["create"]
    assert pub.sync() and len(slices.writes) == 1, "an unchanged slice is not written"
    board.set(0, False, "XID 79")
    assert pub.sync() and generation(slices) == 2
    assert [d["name"] for d in slices.objects[slice_name(NODE)]["spec"]["devices"]] == ["gpu-1"]
    scaling[0] = 0.5
    assert pub.sync() and generation(slices) == 3
    assert pub.stats.writes == 3 and pub.stats.generation == 3 and pub.stats.devices == 1


def test_the_generation_passes_any_seen_in_the_pool_and_stale_slices_go() -> None:
    slices, board = FakeSlices(), HealthBoard(g.index for g in GPUS)
    slices.objects["old-name"] = node_slice(generation=41) | {
        "metadata": {"name": "old-name", "resourceVersion": "1"}
    }
    edited = node_slice(healthy={0: False}, generation=9)  # someone else's edit of ours
    slices.objects[slice_name(NODE)] = edited | {"metadata": {**edited["metadata"], "resourceVersion": "2"}}
    slices._rv = 2
    pub = publisher(slices, board)
    assert pub.sync()
    assert set(slices.objects) == {slice_name(NODE)} and generation(slices) == 42
    assert pub.stats.deletes == 1


def test_api_errors_are_counted_and_retried_not_raised() -> None:
    slices, board = FakeSlices(), HealthBoard(g.index for g in GPUS)
    slices.fail = KubeError("the API server did not answer")
    pub = publisher(slices, board)
    assert not pub.sync()
    assert pub.stats.errors == 1 and "did not answer" in pub.stats.last_error
    slices.fail = None
    assert pub.sync() and generation(slices) == 1


def test_run_publishes_then_withdraws_on_a_clean_stop() -> None:
    slices, board = FakeSlices(), HealthBoard(g.index for g in GPUS)
    pub = publisher(slices, board)
    stop = threading.Event()
    thread = threading.Thread(target=pub.run, args=(stop,))
    thread.start()
    try:
        for _ in range(200):
            if slice_name(NODE) in slices.objects:
                break
            stop.wait(0.01)
        assert slice_name(NODE) in slices.objects
    finally:
        stop.set()
        thread.join(timeout=3)
    assert not thread.is_alive() and slices.objects == {}


class NodeUids:
    """The Node's uid as the API gives it: KubeError while the Node cannot be read."""

    def __init__(self) -> None:
        self.uid: str | None = None
        self.reads = 0

    def __call__(self) -> str:
        self.reads += 1
        if self.uid is None:
            raise KubeError(f"read node {NODE} failed (HTTP 403): forbidden", status=403)
        return self.uid


def test_the_slice_is_owned_by_the_node_once_its_uid_can_be_read(caplog: pytest.LogCaptureFixture) -> None:
    slices, board, uids = FakeSlices(), HealthBoard(g.index for g in GPUS), NodeUids()
    pub = SlicePublisher(slices, GPUS, board, scaling=lambda: 1.0, node_name=NODE, node_uid=uids)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="agent.control.drapublisher"):
        assert pub.sync() and pub.sync()
    stored = slices.objects[slice_name(NODE)]
    assert "ownerReferences" not in stored["metadata"], "published without an owner meanwhile"
    assert uids.reads == 2, "read again on every pass"
    assert [r.getMessage().count("without an ownerReference") for r in caplog.records] == [1]  # logged once
    uids.uid = "node-uid-1"
    assert pub.sync()
    stored = slices.objects[slice_name(NODE)]
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1", "controller": True}
    ]
    assert [w for w, _ in slices.writes] == ["create", "replace"] and generation(slices) == 1
    assert pub.sync() and len(slices.writes) == 2 and uids.reads == 3, "known now: not read again"
    del slices.objects[slice_name(NODE)]  # garbage-collected: a Node re-created under the name
    uids.uid = "node-uid-2"
    assert pub.sync()
    assert slices.objects[slice_name(NODE)]["metadata"]["ownerReferences"][0]["uid"] == "node-uid-2"
