"""agent/emulators/draallocator.py: allocation of vcuda claims by the structured-parameters rules
(consumable capacity, request policies, classes, selectors), read back with
agent/domain/dra.py's claim_shares() as the kubelet plugin will."""

from __future__ import annotations

from typing import Any

import pytest

from agent.domain.dra import claim_shares
from agent.emulators.draallocator import DraAllocationError, allocate_claim
from agent.emulators.draclaims import extended_resource_claim, extended_resource_classes, generate_name
from agent.emulators.drapools import Policy, published_devices, quantity
from tests.unit.drafixtures import CLASS, GPUS, NODE, claim, device_class, node_slice, share_config

Doc = dict[str, Any]


class Cluster:
    """Classes, slices and the claims allocated so far (what the scheduler sees)."""

    def __init__(self, *slices: Doc) -> None:
        self.classes = {CLASS: device_class()}
        self.slices = list(slices) or [node_slice()]
        self.allocated: list[Doc] = []

    def allocate(self, obj: Doc, node: str | None = None) -> Doc:
        allocation = allocate_claim(obj, self.classes, self.slices, self.allocated, node)
        done = {**obj, "status": {"allocation": allocation}}
        self.allocated.append(done)
        return done


def consumed(obj: Doc) -> list[tuple[str, dict[str, str]]]:
    results = obj["status"]["allocation"]["devices"]["results"]
    return [(r["device"], r["consumedCapacity"]) for r in results]


def test_a_share_fits_and_reads_back_as_the_plugin_will() -> None:
    done = Cluster().allocate(claim("a", cores="30", memory="4Gi", config=[share_config("burst-share", 60)]))
    allocation = done["status"]["allocation"]
    [result] = allocation["devices"]["results"]
    assert (result["request"], result["driver"], result["pool"], result["device"]) == (
        "gpu",
        "gpu.vcuda.io",
        NODE,
        "gpu-0",
    )
    assert result["consumedCapacity"] == {"cores": "30", "memory": "4Gi"}
    assert len(result["shareID"]) == 36
    assert allocation["devices"]["config"] == [{"source": "FromClaim", **share_config("burst-share", 60)}]
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
    }
    [share] = claim_shares(done, NODE)
    assert (share.gpu_index, share.cores, share.memory_mib, share.policy, share.limit) == (
        0,
        30,
        4096,
        "burst-share",
        60,
    )


def test_two_claims_share_one_gpu_and_a_third_moves_on() -> None:
    cluster = Cluster()
    first = cluster.allocate(claim("a", cores="60", memory="40Gi"))
    second = cluster.allocate(claim("b", cores="40", memory="30Gi"))
    assert consumed(first)[0][0] == consumed(second)[0][0] == "gpu-0"
    assert (
        first["status"]["allocation"]["devices"]["results"][0]["shareID"]
        != (second["status"]["allocation"]["devices"]["results"][0]["shareID"])
    )
    third = cluster.allocate(claim("c", cores="1"))
    assert consumed(third) == [("gpu-1", {"cores": "1", "memory": "0"})], "gpu-0 has no core left"


@pytest.mark.parametrize(
    ("held", "asked", "words"),
    [
        (("70", None), ("40", None), "cores: 70 consumed + 40 requested > 100"),
        (
            (None, "80000Mi"),
            ("1", "2000Mi"),
            "memory: 80000Mi consumed + 2000Mi requested > 81559Mi",
        ),
    ],
)
def test_over_consumption_is_refused_for_cores_and_for_memory(
    held: tuple[str | None, str | None], asked: tuple[str | None, str | None], words: str
) -> None:
    one_gpu = Cluster(node_slice(gpus=GPUS[:1]))
    one_gpu.allocate(claim("a", cores=held[0] or "1", memory=held[1]))
    with pytest.raises(DraAllocationError) as caught:
        one_gpu.allocate(claim("b", cores=asked[0], memory=asked[1]))
    assert words in str(caught.value) and "request gpu needs 1 device(s), found 0" in str(caught.value)
    assert len(one_gpu.allocated) == 1


def test_requests_round_up_to_the_policy_and_absent_ones_take_the_default() -> None:
    cluster = Cluster()
    rounded = cluster.allocate(claim("a", cores="0", memory="1500Ki"))
    assert consumed(rounded) == [("gpu-0", {"cores": "1", "memory": "2Mi"})], "below min → min; 1500Ki → 2Mi"
    whole = cluster.allocate(claim("b"))
    assert consumed(whole) == [("gpu-1", {"cores": "100", "memory": "0"})], (
        "no request: the whole GPU's cores"
    )
    with pytest.raises(DraAllocationError, match="cores 150 is outside its request policy"):
        cluster.allocate(claim("c", cores="150"))


def test_the_policy_rules_match_the_schedulers() -> None:
    memory = Policy(value=8 << 30, default=0, minimum=0, step=1 << 20, binary=True)
    assert [memory.consume(x) for x in (None, 0, 1, (1 << 20) + 1)] == [0, 0, 1 << 20, 2 << 20]
    shares = Policy(value=100, default=100, minimum=10, maximum=100, step=10)
    assert [shares.consume(x) for x in (None, 5, 11, 100, 101)] == [100, 10, 20, 100, None]
    values = Policy(value=8, default=2, valid_values=(2, 4, 8))
    assert [values.consume(x) for x in (3, 8, 9)] == [4, 8, None]
    assert Policy(value=7).consume(None) == 7 and Policy(value=7).consume(3) == 3
    assert (quantity(4 << 30, True), quantity(1536 << 20, True), quantity(30, False)) == (
        "4Gi",
        "1536Mi",
        "30",
    )


def test_a_claim_for_another_class_or_driver_gets_nothing() -> None:
    cluster = Cluster()
    with pytest.raises(DraAllocationError, match=r"DeviceClass 'gpu\.nvidia\.com' not found"):
        cluster.allocate(claim("a", cores="10", device_class="gpu.nvidia.com"))
    cluster.classes["nvidia"] = {
        "metadata": {"name": "nvidia"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
    }
    with pytest.raises(DraAllocationError, match="no free device matches the class and selectors"):
        cluster.allocate(claim("b", cores="10", device_class="nvidia"))
    assert cluster.allocated == []


def test_attribute_equality_selectors_and_nothing_else() -> None:
    cluster = Cluster()
    pick = claim("a", cores="10", selectors=["device.attributes['gpu.vcuda.io'].index == 1"])
    assert consumed(cluster.allocate(pick))[0][0] == "gpu-1"
    numa = (
        "device.attributes['resource.kubernetes.io'].numaNode == 0"
        " && device.attributes['gpu.vcuda.io'].type == 'gpu'"
    )
    assert consumed(cluster.allocate(claim("b", cores="10", selectors=[numa])))[0][0] == "gpu-0"
    with pytest.raises(DraAllocationError, match="no free device"):
        cluster.allocate(
            claim("c", cores="10", selectors=["device.attributes['gpu.vcuda.io'].productName == 'A100'"])
        )
    with pytest.raises(DraAllocationError, match="outside the modelled subset"):
        cluster.allocate(
            claim("d", cores="10", selectors=["device.capacity['gpu.vcuda.io'].cores.isGreaterThan(1)"])
        )


def test_one_request_takes_distinct_devices_and_an_unhealthy_gpu_is_not_offered() -> None:
    cluster = Cluster()
    both = cluster.allocate(claim("a", cores="10", count=2))
    assert [d for d, _ in consumed(both)] == ["gpu-0", "gpu-1"]
    with pytest.raises(DraAllocationError, match="needs 3 device"):
        cluster.allocate(claim("b", cores="10", count=3))
    sick = Cluster(node_slice(healthy={0: False}))
    assert consumed(sick.allocate(claim("c", cores="10")))[0][0] == "gpu-1"


def test_only_the_highest_generation_of_a_complete_pool_counts() -> None:
    old, new = node_slice(generation=1), node_slice(healthy={0: False}, generation=2)
    new["metadata"]["name"] = "renamed"
    assert [d.name for d in published_devices([old, new])] == ["gpu-1"]
    incomplete = node_slice(generation=3)
    incomplete["spec"]["pool"]["resourceSliceCount"] = 2
    assert published_devices([incomplete]) == [], "a pool being updated is not used"


def test_class_config_comes_first_and_the_claims_overrides_it() -> None:
    cluster = Cluster()
    cluster.classes[CLASS] = {
        **device_class(),
        "spec": {**device_class()["spec"], "config": [share_config("fixed-share")]},
    }
    done = cluster.allocate(claim("a", cores="20", config=[share_config("best-effort")]))
    config = done["status"]["allocation"]["devices"]["config"]
    assert [c["source"] for c in config] == ["FromClass", "FromClaim"]
    assert all("requests" not in c for c in config), "both apply to the claim's only request"
    assert claim_shares(done, NODE)[0].policy == "best-effort"
    only_class = cluster.allocate(claim("b", cores="20"))
    assert claim_shares(only_class, NODE)[0].policy == "fixed-share"


def test_nodes_are_tried_in_order_unless_one_is_given() -> None:
    cluster = Cluster(node_slice("node-a", GPUS[:1]), node_slice("node-b", GPUS[:1]))
    cluster.allocate(claim("a", cores="90"))
    moved = cluster.allocate(claim("b", cores="20"))
    assert moved["status"]["allocation"]["devices"]["results"][0]["pool"] == "node-b"
    with pytest.raises(DraAllocationError, match="node node-a: request gpu needs 1"):
        cluster.allocate(claim("c", cores="20"), node="node-a")


def test_extended_resources_ask_for_devices_not_capacity() -> None:
    """KEP-5004 in 1.36: N units of a class's extendedResourceName are N devices at the defaults.
    So `gpu.vcuda.io/gpu: 1` is one whole GPU, and a class mapping nvidia.com/vcuda-core would
    turn `vcuda-core: 30` into 30 devices: why deploy/overlays/dra does not map it."""
    mapping = extended_resource_classes([device_class()])
    assert mapping == {"deviceclass.resource.kubernetes.io/vcuda-gpu": CLASS, "gpu.vcuda.io/gpu": CLASS}
    pod = {
        "metadata": {"name": "trainer", "namespace": "default", "uid": "uid-trainer"},
        "spec": {
            "containers": [{"name": "main", "resources": {"limits": {"gpu.vcuda.io/gpu": "1", "cpu": "2"}}}]
        },
    }
    made = extended_resource_claim(pod, mapping, {})
    assert made is not None
    obj, mappings = made
    assert obj["spec"]["devices"]["requests"] == [
        {
            "name": "container-0-request-1",
            "exactly": {"deviceClassName": CLASS, "allocationMode": "ExactCount", "count": 1},
        }
    ]
    assert mappings == [
        {"containerName": "main", "resourceName": "gpu.vcuda.io/gpu", "requestName": "container-0-request-1"}
    ]
    assert extended_resource_claim(pod, mapping, {"gpu.vcuda.io/gpu": "4"}) is None, (
        "a device plugin serves it"
    )
    cluster = Cluster()
    whole = cluster.allocate({**obj, "metadata": {**obj["metadata"], "name": "x", "uid": "u"}})
    assert consumed(whole) == [("gpu-0", {"cores": "100", "memory": "0"})]
    core_pod = {
        **pod,
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/vcuda-core": "30"}}}]},
    }
    core_made = extended_resource_claim(core_pod, {"nvidia.com/vcuda-core": CLASS}, {})
    assert core_made is not None
    with pytest.raises(DraAllocationError, match="needs 30 device"):
        cluster.allocate({**core_made[0], "metadata": {**core_made[0]["metadata"], "name": "y", "uid": "v"}})


def test_generated_claim_names_keep_both_parts() -> None:
    assert generate_name("web-0", "gpu") == "web-0-gpu-"
    long = generate_name("p" * 60, "c" * 30)
    assert len(long) <= 58 and long.startswith("p") and "-c" in long and long.endswith("-")


def test_what_is_not_modelled_is_refused_with_a_reason() -> None:
    cluster = Cluster()
    with pytest.raises(DraAllocationError, match="only integer quantities are modelled"):
        cluster.allocate(claim("a", memory="1.5Gi"))
    prioritized = claim("b")
    prioritized["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": [{"name": "x"}]}]
    with pytest.raises(DraAllocationError, match="not firstAvailable"):
        cluster.allocate(prioritized)
    everything = claim("c")
    everything["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] = "All"
    with pytest.raises(DraAllocationError, match="allocationMode All"):
        cluster.allocate(everything)
    assert cluster.allocated == []
