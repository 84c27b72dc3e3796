"""ExtenderView: what pod and node events charge, and how bind reservations live and end."""

from __future__ import annotations

from typing import Any

import pytest

from agent.clock import VirtualClock
from agent.control.extenderview import NOT_MANAGED, ExtenderView
from agent.domain.annotations import GPU_ASSIGNED, PREDICATE_NODE, PREDICATE_TIME, predicate_key
from agent.domain.clusterbook import ClusterBook, NoFitError
from agent.domain.nodeinventory import INVENTORY_ANNOTATION, GpuEntry, NodeInventory, encode
from agent.domain.schedrequest import pod_demand
from agent.platform.kube.pods import pod_from_json

NODE = "n1"
IDX0 = predicate_key(0, False)


def node_obj(rv: str = "1", gpus: int = 1, heartbeat: float = 1000.0) -> dict[str, Any]:
    entries = tuple(GpuEntry(i, f"GPU-{i}", "H100", 81559, 73403, 0, True) for i in range(gpus))
    text = encode(NodeInventory(NODE, heartbeat, 0.9, entries))
    return {"metadata": {"name": NODE, "resourceVersion": rv, "annotations": {INVENTORY_ANNOTATION: text}}}


def pod_obj(
    uid: str, cores: int = 60, node: str = "", annotations: dict[str, str] | None = None, **meta: Any
) -> dict[str, Any]:
    limits = {"nvidia.com/vcuda-core": str(cores), "nvidia.com/vcuda-memory": "1024"}
    return {
        "metadata": {"name": uid, "namespace": "d", "uid": uid, "annotations": annotations or {}, **meta},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": "Pending"},
    }


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(1000.0)


@pytest.fixture
def view(clock: VirtualClock) -> ExtenderView:
    v = ExtenderView(ClusterBook(), clock=clock, reservation_ttl_s=60.0)
    v.on_node_event("ADDED", node_obj())
    return v


def reserve(view: ExtenderView, obj: dict[str, Any]) -> None:
    pod = pod_from_json(obj)
    demand = pod_demand(pod)
    assert demand is not None
    view.reserve(pod, demand, NODE)


def fits(view: ExtenderView, cores: int) -> bool:
    demand = pod_demand(pod_from_json(pod_obj("probe", cores)))
    assert demand is not None
    return view.filter(demand, [NODE])[0] == [NODE]


def test_bound_pods_are_charged_and_deletion_uncharges(view: ExtenderView) -> None:
    view.on_pod_event("ADDED", pod_obj("a", 60, NODE, {IDX0: "0", PREDICATE_NODE: NODE}))
    assert not fits(view, 50) and fits(view, 40)
    view.on_pod_event("DELETED", pod_obj("a", 60, NODE))
    assert fits(view, 100)


def test_predicate_annotations_on_an_unbound_pod_charge_nothing(view: ExtenderView) -> None:
    # A tenant may write them on its own Pending pod: without spec.nodeName (only a Binding or
    # the creator sets it, and kubelet admits a bound pod only within the node's capacity) or
    # a reservation of our bind, they hold no GPU.
    forged = {IDX0: "0", PREDICATE_NODE: NODE, PREDICATE_TIME: "1", GPU_ASSIGNED: "false"}
    view.on_pod_event("ADDED", pod_obj("forged", 60, "", forged))
    view.on_pod_event("MODIFIED", pod_obj("forged", 60, "", forged))
    assert view.charge_of("forged") is None and fits(view, 100)
    # Our own bind of that pod does charge it, whatever it says.
    reserve(view, pod_obj("forged", 60, "", forged))
    assert not fits(view, 50)
    view.release("forged")  # the bind failed: back to what the API says, nothing
    assert view.charge_of("forged") is None and fits(view, 100)


def test_finished_pods_are_uncharged_and_terminating_pods_are_not(view: ExtenderView) -> None:
    running = pod_obj(
        "a", 60, NODE, {IDX0: "0", PREDICATE_NODE: NODE}, deletionTimestamp="2026-01-01T00:00:00Z"
    )
    view.on_pod_event("ADDED", running)
    assert not fits(view, 50)  # still terminating: its containers hold the GPU
    done = pod_obj("a", 60, NODE, {IDX0: "0", PREDICATE_NODE: NODE})
    done["status"]["phase"] = "Succeeded"
    view.on_pod_event("MODIFIED", done)
    assert fits(view, 100)


def test_annotations_for_another_node_are_not_trusted(view: ExtenderView) -> None:
    view.on_pod_event("ADDED", pod_obj("a", 60, NODE, {IDX0: "0", PREDICATE_NODE: "elsewhere"}))
    charge = view.charge_of("a")
    assert charge is not None and charge.node == NODE and dict(charge.gpus) == {}


def test_a_reservation_survives_events_from_before_the_bind(view: ExtenderView) -> None:
    reserve(view, pod_obj("a", 60))
    view.on_pod_event("MODIFIED", pod_obj("a", 60))  # the pod as it was before our PATCH
    assert view.reservations() == {"a": NODE} and not fits(view, 50)
    view.on_pod_event("MODIFIED", pod_obj("a", 60, "", {IDX0: "0", PREDICATE_NODE: NODE}))
    assert view.reservations() == {"a": NODE}
    view.confirm("a")
    view.on_pod_event("MODIFIED", pod_obj("a", 60, NODE, {IDX0: "0", PREDICATE_NODE: NODE}))
    assert view.reservations() == {} and not fits(view, 50)
    charge = view.charge_of("a")
    assert charge is not None and dict(charge.gpus) == {(False, 0): (0,)}


def test_release_restores_what_the_api_says(view: ExtenderView) -> None:
    view.on_pod_event("ADDED", pod_obj("a", 60))
    reserve(view, pod_obj("a", 60))
    assert not fits(view, 50)
    view.release("a")
    assert view.reservations() == {} and fits(view, 100)


def test_a_reservation_the_watch_never_confirms_expires(view: ExtenderView, clock: VirtualClock) -> None:
    reserve(view, pod_obj("ghost", 60))
    view.confirm("ghost")
    clock.advance(30)
    view.on_node_event("MODIFIED", node_obj("2", heartbeat=clock.wall()))
    assert not fits(view, 50)
    clock.advance(31)
    assert fits(view, 100) and view.reservations() == {}


def test_deleting_a_reserved_pod_ends_its_reservation(view: ExtenderView) -> None:
    reserve(view, pod_obj("a", 60))
    view.on_pod_event("DELETED", pod_obj("a", 60))
    assert view.reservations() == {} and fits(view, 100)


def test_reserve_refuses_what_does_not_fit(view: ExtenderView) -> None:
    reserve(view, pod_obj("a", 60))
    with pytest.raises(NoFitError):
        reserve(view, pod_obj("b", 60))
    assert view.reservations() == {"a": NODE} and view.charge_of("b") is None


def test_nodes_without_inventory_and_older_request_nodes(view: ExtenderView) -> None:
    view.on_node_event("ADDED", {"metadata": {"name": "cpu", "resourceVersion": "5"}})
    demand = pod_demand(pod_from_json(pod_obj("probe", 10)))
    assert demand is not None
    assert view.filter(demand, ["cpu"])[1]["cpu"] == NOT_MANAGED
    # A Node in a request that is older than the watched one does not replace it.
    view.on_node_event("MODIFIED", node_obj("10", gpus=2))
    view.observe_nodes([node_obj("9", gpus=1)])
    assert len(view.gpu_usage(NODE)) == 2
    view.observe_nodes([node_obj("11", gpus=1)])
    assert len(view.gpu_usage(NODE)) == 1
    bad = node_obj("12")
    bad["metadata"]["annotations"][INVENTORY_ANNOTATION] = "{"
    view.on_node_event("MODIFIED", bad)
    assert "unusable" in view.filter(demand, [NODE])[1][NODE]


def test_ready_after_both_caches_synced(view: ExtenderView) -> None:
    assert not view.ready
    view.mark_synced("nodes")
    assert not view.ready
    view.mark_synced("pods")
    assert view.ready
