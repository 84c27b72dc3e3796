"""The extender's decision for hardware-isolated shares: the node inventory marks a GPU in MIG
mode that still offers vcuda-core as on demand, with the room left per profile; a pod
annotated ``nvidia.com/vcuda-isolation: mig`` passes the filter only where a MIG instance
covering each container still fits, a pod without it never lands on an on-demand GPU, and a
bad annotation value is unresolvable."""

from __future__ import annotations

import json
from typing import cast

import pytest

from agent.clock import VirtualClock
from agent.control.extenderbind import Binder
from agent.control.extenderview import ExtenderView, isolated_pod
from agent.domain.clusterbook import ClusterBook, NoFitError
from agent.domain.isolatedfit import NO_ON_DEMAND, isolated_fit
from agent.domain.miginventory import gi_profile_name, mig_entry
from agent.domain.nodeinventory import (
    INVENTORY_ANNOTATION,
    InventoryFormatError,
    NodeInventory,
    build_inventory,
    decode,
    encode,
)
from agent.domain.schedrequest import PackPolicy, SchedulingRequestError
from agent.platform.gpu.inventory import GpuInfo, Topology
from agent.platform.gpu.migstate import MigDevice, MigInfo
from agent.surfaces.extender.service import ExtenderService
from tests.unit.extenderbook import NOW, one, pod, share
from tests.unit.kubefixtures import container as kube_container
from tests.unit.kubefixtures import make_pod, pod_json

H100 = "NVIDIA H100 80GB HBM3"
GPUS = [GpuInfo(0, "GPU-a", H100, 81559, 0, "0:0", 0), GpuInfo(1, "GPU-b", H100, 81559, 1, "0:1", 0)]
PROFILES = {"3g.40gb": (9, 40448), "2g.20gb": (14, 20096), "1g.10gb": (19, 9984)}


def device(gi: int, profile: str, start: int, size: int) -> MigDevice:
    pid, memory = PROFILES[profile]
    return MigDevice(0, gi, gi, 0, f"MIG-{gi}", profile, profile, pid, 0, start, size, memory, 60)


def node(name: str, *devices: MigDevice, on_demand: bool = True) -> NodeInventory:
    """GPU 0 in MIG mode with ``devices``: on demand (it offers shares), or withheld; GPU 1 plain."""
    info = MigInfo(True, True, True, tuple(devices))
    withheld = [] if on_demand else [0]
    mig = {0: mig_entry(info), 1: mig_entry(MigInfo(True))}
    return build_inventory(
        name, GPUS, Topology(), healthy={}, scaling=1.0, heartbeat=NOW, mig=mig, withheld=withheld
    )


def book(*inventories: NodeInventory) -> ClusterBook:
    b = ClusterBook()
    for inv in inventories:
        b.set_node(inv.node, inv)
    return b


def test_the_inventory_marks_on_demand_gpus_with_the_room_left() -> None:
    inv = node("n1", device(1, "3g.40gb", 4, 4))
    raw = json.loads(encode(inv))
    mig0 = raw["gpus"][0]["mig"]
    assert mig0["onDemand"] is True and raw["gpus"][0]["cores"] == 100
    assert mig0["room"]["3g.40gb"] == 1 and mig0["room"]["4g.40gb"] == 1 and mig0["room"]["7g.80gb"] == 0
    assert mig0["room"]["1g.10gb"] == 4  # slots 0..3 left
    assert "onDemand" not in raw["gpus"][1]["mig"]  # not in MIG mode
    assert decode(encode(inv)) == inv
    withheld = json.loads(encode(node("n2", device(1, "3g.40gb", 4, 4), on_demand=False)))
    assert "onDemand" not in withheld["gpus"][0]["mig"] and withheld["gpus"][0]["cores"] == 0
    bad = dict(raw)
    bad["gpus"][0]["mig"]["room"] = {"3g.40gb": -1}
    with pytest.raises(InventoryFormatError, match="room must be an object of MIG profile -> count"):
        decode(json.dumps(bad))


def test_an_isolated_pod_goes_where_its_smallest_profile_still_fits() -> None:
    full = node("full", device(1, "3g.40gb", 4, 4), device(2, "3g.40gb", 0, 4))
    half = node("half", device(1, "3g.40gb", 4, 4))
    plain = node("plain", device(1, "3g.40gb", 4, 4), on_demand=False)
    b = book(full, half, plain)
    passed, failed = b.filter(one(30, 20000), ["full", "half", "plain"], NOW, isolated=True)
    assert passed == ["half"]
    assert "no room on the GPU for a MIG instance of 3g.40gb" in failed["full"]
    assert "(it has 3g.40gb, 3g.40gb)" in failed["full"]
    assert failed["plain"] == NO_ON_DEMAND
    # 50 cores need 66 SMs: only 7g.80gb covers it, and half's 3g is in the way.
    passed, failed = b.filter(one(50, 10000), ["half"], NOW, isolated=True)
    assert passed == [] and "7g.80gb" in failed["half"]
    scores = b.prioritize(
        one(30, 20000), ["full", "half"], NOW, PackPolicy.BINPACK, PackPolicy.BINPACK, isolated=True
    )
    assert scores == {"full": 0, "half": 10}
    assignment = b.reserve("uid-1", "half", one(30, 20000), PackPolicy.BINPACK, NOW, isolated=True)
    assert assignment.gpus == {(False, 0): (0,)}
    with pytest.raises(NoFitError, match="no room"):
        b.reserve("uid-2", "full", one(30, 20000), PackPolicy.BINPACK, NOW, isolated=True)


def test_a_pods_containers_are_placed_one_beside_the_other() -> None:
    inv = node("n1", device(1, "3g.40gb", 4, 4))
    two = pod(share(30, 20000, "a", 0), share(30, 20000, "b", 1))
    assert isolated_fit(inv, two)[0] is None  # one 3g.40gb slot left, two asked
    small = pod(share(10, 5000, "a", 0), share(10, 5000, "b", 1))
    placement, _ = isolated_fit(inv, small)
    assert placement == {(False, 0): (0,), (False, 1): (0,)}
    whole = isolated_fit(inv, one(100))
    assert whole[0] is None and "below 100 vcuda-core" in whole[1]


def test_a_pod_without_the_annotation_never_lands_on_an_on_demand_gpu() -> None:
    b = book(node("n1"))  # GPU 0 on demand and empty, GPU 1 plain
    assert b.reserve("a", "n1", one(30, 20000), PackPolicy.BINPACK, NOW).gpus == {(False, 0): (1,)}
    b.reserve("b", "n1", one(60, 20000), PackPolicy.BINPACK, NOW)  # GPU 1 has 10 cores left
    passed, failed = b.filter(one(30, 1000), ["n1"], NOW)
    assert passed == [] and "n1" in failed  # GPU 0's 100 cores are for isolated shares only
    whole = book(node("n2"))
    assert whole.reserve("w", "n2", one(100), PackPolicy.BINPACK, NOW).gpus == {(False, 0): (1,)}
    with pytest.raises(NoFitError):
        whole.reserve("w2", "n2", one(100), PackPolicy.BINPACK, NOW)  # GPU 0 is not a whole GPU to give


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [({}, False), ({"nvidia.com/vcuda-isolation": "mig"}, True)],
)
def test_isolation_is_read_from_the_pod(annotations: dict[str, str], expected: bool) -> None:
    assert isolated_pod(make_pod("p", annotations=annotations)) is expected


@pytest.mark.parametrize("value", ["MIG", " mig", "mig ", "true", "", "x" * 300])
def test_any_other_isolation_value_is_unresolvable(value: str) -> None:
    with pytest.raises(SchedulingRequestError, match="the only value is 'mig'") as err:
        isolated_pod(make_pod("p", annotations={"nvidia.com/vcuda-isolation": value}))
    assert len(str(err.value)) < 400  # a long hostile value is not echoed whole


def test_gi_profile_names() -> None:
    assert gi_profile_name("1c.3g.40gb") == "3g.40gb"
    assert gi_profile_name("3g.40gb") == "3g.40gb" and gi_profile_name("1g.10gb+me") == "1g.10gb+me"


def test_the_extender_filters_a_request_body_by_isolation() -> None:
    view = ExtenderView(ClusterBook(), clock=VirtualClock(NOW))
    for inv in (node("full", device(1, "3g.40gb", 4, 4), device(2, "3g.40gb", 0, 4)), node("half")):
        meta = {"name": inv.node, "resourceVersion": "1", "annotations": {INVENTORY_ANNOTATION: encode(inv)}}
        view.on_node_event("ADDED", {"metadata": meta})
    service = ExtenderService(view, cast(Binder, None))  # filter never binds

    def body(annotations: dict[str, str]) -> bytes:
        container = kube_container("c", 30, 20000)
        return json.dumps(
            {"pod": pod_json("p", container, annotations=annotations), "nodenames": ["full", "half"]}
        ).encode()

    isolated = service.filter(body({"nvidia.com/vcuda-isolation": "mig"}))
    assert isolated["nodenames"] == ["half"] and "no room" in isolated["failedNodes"]["full"]
    plain = service.filter(body({}))
    assert plain["nodenames"] == ["full", "half"]  # on both nodes' GPU 1, the plain one
    bad = service.filter(body({"nvidia.com/vcuda-isolation": "yes"}))
    assert bad["nodenames"] == [] and "the only value is 'mig'" in bad["failedAndUnresolvableNodes"]["half"]
