"""The node's ResourceSlice over real HTTP against the fake API server (agent/control/drapublisher.py
with agent/platform/kube/resourceslices.py), and a claim from ResourceClaimTemplate to an
allocated, reserved ResourceClaim (agent/emulators/draclaims.py), every object checked against
the Kubernetes 1.36 OpenAPI schema."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client import ApiClient, CoreV1Api, ResourceV1Api

from agent.control.drapublisher import SlicePublisher
from agent.domain.dra import DRIVER, claim_ref, claim_shares
from agent.domain.draslice import pool_generation, slice_name
from agent.domain.health import HealthBoard
from agent.emulators.apiserver import FakeApiServer
from agent.emulators.draallocator import DraAllocationError
from agent.emulators.draclaims import EXTENDED_RESOURCE_CLAIM_ANNOTATION, POD_CLAIM_NAME_ANNOTATION, PodClaims
from agent.errors import KubeError
from agent.platform.kube.nodes import NodeClient
from agent.platform.kube.resourceslices import ResourceSliceClient
from tests.integration.deploy_render import DRA_SCHEMA_VERSIONS, load_yaml, validate
from tests.integration.kubeapi import apiserver, kube, running, wait_until
from tests.unit.drafixtures import GPUS, NODE, device_class, node_slice

__all__ = ["apiserver", "kube"]  # fixtures

Doc = dict[str, Any]
EXAMPLE = "deploy/examples/dra-share-30.yaml"


def our_slice(server: FakeApiServer) -> Doc | None:
    return server.get_object("resourceslices", slice_name(NODE))


def with_devices(server: FakeApiServer, count: int) -> Doc | None:
    """Our slice once it has ``count`` devices."""
    obj = our_slice(server)
    return obj if obj is not None and len(obj["spec"]["devices"]) == count else None


@pytest.fixture
def board() -> HealthBoard:
    return HealthBoard(g.index for g in GPUS)


@pytest.fixture
def publisher(kube: ApiClient, board: HealthBoard) -> SlicePublisher:
    return SlicePublisher(
        ResourceSliceClient(kube, NODE, DRIVER),
        GPUS,
        board,
        scaling=lambda: 0.9,
        node_name=NODE,
        driver_version="550.54.15",
        check_interval_s=0.3,
    )


@pytest.fixture
def published(apiserver: FakeApiServer, publisher: SlicePublisher) -> Iterator[SlicePublisher]:
    with running(publisher.run, "slice-publisher"):
        wait_until(lambda: our_slice(apiserver), what="the slice is published")
        yield publisher


def test_the_slice_is_published_at_start_and_is_a_valid_136_object(
    apiserver: FakeApiServer, published: SlicePublisher
) -> None:
    obj = our_slice(apiserver)
    assert obj is not None
    assert [d["name"] for d in obj["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert obj["spec"]["devices"][0]["capacity"]["memory"]["value"] == "73403Mi"
    assert pool_generation(obj) == 1
    wait_until(lambda: published.stats.writes == 1, what="the write is counted")
    validate(obj)
    typed = ResourceV1Api(published._slices._resource.api_client).read_resource_slice(slice_name(NODE))
    assert typed.spec.pool.generation == 1


def test_an_unhealthy_gpu_leaves_the_slice_within_one_second(
    apiserver: FakeApiServer, published: SlicePublisher, board: HealthBoard
) -> None:
    started = time.monotonic()
    board.set(1, False, "XID 79 (GPU has fallen off the bus)")

    obj = wait_until(lambda: with_devices(apiserver, 1), timeout_s=2.0, what="gpu-1 leaves the slice")
    assert time.monotonic() - started < 1.0
    assert obj["spec"]["devices"][0]["name"] == "gpu-0" and pool_generation(obj) == 2
    board.set(1, True, "GPU recovered")
    back = wait_until(lambda: with_devices(apiserver, 2), what="gpu-1 back in the slice")
    assert pool_generation(back) == 3


def test_a_deleted_or_edited_slice_is_put_back_and_stale_ones_go(
    apiserver: FakeApiServer, published: SlicePublisher
) -> None:
    apiserver.delete_object("resourceslices", slice_name(NODE))
    wait_until(lambda: our_slice(apiserver), what="the slice is re-created by the periodic check")
    stale = node_slice(generation=5)
    stale["metadata"]["name"] = "gpu-node-1-old"
    apiserver.create_object("resourceslices", stale)
    apiserver.create_object("resourceslices", node_slice("gpu-node-2"))  # another node's: left alone
    wait_until(
        lambda: apiserver.get_object("resourceslices", "gpu-node-1-old") is None, what="stale slice deleted"
    )
    names = sorted(s["metadata"]["name"] for s in apiserver.objects("resourceslices"))
    assert names == ["gpu-node-1-gpu.vcuda.io", "gpu-node-2-gpu.vcuda.io"]
    edited = node_slice(healthy={0: False}, generation=7)  # someone else's edit of ours
    apiserver.store.update(
        "resourceslices", "", slice_name(NODE), lambda cur: {**cur, "spec": edited["spec"]}
    )
    obj = wait_until(lambda: with_devices(apiserver, 2), what="the edit undone")
    assert pool_generation(obj) == 8, "above every generation seen in the pool"


def test_the_slice_is_owned_by_the_node_and_collected_with_it(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    """Without a readable Node the slice is published without an owner; once the Node exists
    it gets the ownerReference (same generation), and deleting the Node deletes the slice."""
    publisher = SlicePublisher(
        ResourceSliceClient(kube, NODE, DRIVER),
        GPUS,
        HealthBoard(g.index for g in GPUS),
        scaling=lambda: 0.9,
        node_name=NODE,
        check_interval_s=0.3,
        delete_on_stop=False,
        node_uid=NodeClient(kube, NODE).uid,
    )
    with running(publisher.run, "slice-publisher"):
        obj = wait_until(lambda: our_slice(apiserver), what="published while the Node is missing")
        assert "ownerReferences" not in obj["metadata"]
        node = apiserver.create_node(NODE)
        owned = wait_until(
            lambda: (our_slice(apiserver) or {}).get("metadata", {}).get("ownerReferences"),
            what="the Node becomes the owner",
        )
        uid = node["metadata"]["uid"]
        assert owned == [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]
        stored = our_slice(apiserver)
        assert stored is not None and pool_generation(stored) == 1
        validate(stored)
    apiserver.create_object("resourceslices", node_slice("gpu-node-2"))  # unowned: stays
    apiserver.delete_node(NODE)
    assert our_slice(apiserver) is None, "garbage-collected with its Node"
    assert [s["metadata"]["name"] for s in apiserver.objects("resourceslices")] == ["gpu-node-2-gpu.vcuda.io"]


def test_api_errors_are_retried_and_a_clean_stop_withdraws_the_slice(
    apiserver: FakeApiServer, publisher: SlicePublisher
) -> None:
    apiserver.refuse("POST", "/apis/resource.k8s.io/v1/resourceslices", 503)
    with running(publisher.run, "slice-publisher"):
        wait_until(lambda: publisher.stats.errors >= 1, what="a refused create is counted")
        assert our_slice(apiserver) is None and "503" in publisher.stats.last_error
        apiserver.allow()
        wait_until(lambda: our_slice(apiserver), what="published once the API server accepts")
    assert our_slice(apiserver) is None, "deleted on a clean stop"


def test_the_client_translates_errors(apiserver: FakeApiServer, kube: ApiClient) -> None:
    client = ResourceSliceClient(kube, NODE, DRIVER)
    client.create(node_slice())
    with pytest.raises(KubeError) as caught:
        client.create(node_slice())
    assert caught.value.status == 409
    assert client.delete(slice_name(NODE)) and not client.delete(slice_name(NODE))
    with pytest.raises(KubeError, match=r"without metadata\.name"):
        client.create({"spec": {}})


def test_a_template_becomes_an_allocated_claim_reserved_for_its_pod(
    apiserver: FakeApiServer, kube: ApiClient, published: SlicePublisher
) -> None:
    """The whole DRA path: DeviceClass + published slice, a ResourceClaimTemplate and a pod using
    it (created over HTTP), the claim made and allocated, then read over HTTP as the kubelet
    plugin will read it."""
    resource: Any = ResourceV1Api(kube)  # typed models used untyped, as in test_apiserver.py
    core: Any = CoreV1Api(kube)
    resource.create_device_class(device_class())
    template, pod = load_yaml(EXAMPLE)
    resource.create_namespaced_resource_claim_template("default", template)
    pod["spec"]["nodeName"] = NODE
    core.create_namespaced_pod("default", pod)
    pods = PodClaims(apiserver.store)
    [stored] = pods.admit("default", "cuda-dra-30", NODE)
    name = stored["metadata"]["name"]
    assert name.startswith("cuda-dra-30-gpu-") and len(name) == len("cuda-dra-30-gpu-") + 5
    claim = resource.read_namespaced_resource_claim(name, "default", _preload_content=False)
    obj = json.loads(claim.data)
    assert obj["metadata"]["annotations"][POD_CLAIM_NAME_ANNOTATION] == "gpu"
    [owner] = obj["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Pod", "cuda-dra-30", True)
    assert obj["status"]["reservedFor"] == [{"resource": "pods", "name": "cuda-dra-30", "uid": owner["uid"]}]
    [share] = claim_shares(obj, NODE)
    assert (share.device, share.cores, share.memory_mib, share.policy) == ("gpu-0", 30, 4096, "fixed-share")
    assert claim_ref(obj).uid == obj["metadata"]["uid"]
    validate(obj)
    statuses = core.read_namespaced_pod("cuda-dra-30", "default").status.resource_claim_statuses
    assert [(s.name, s.resource_claim_name) for s in statuses] == [("gpu", name)]
    assert pods.admit("default", "cuda-dra-30", NODE)[0]["metadata"]["name"] == name, "idempotent"


def test_the_extended_resource_path_gets_whole_gpus_and_cleans_up_a_misfit(
    apiserver: FakeApiServer, published: SlicePublisher
) -> None:
    apiserver.create_object("deviceclasses", device_class())
    apiserver.create_node(NODE)  # allocatable without gpu.vcuda.io/gpu: DRA serves it
    limits = {"limits": {"gpu.vcuda.io/gpu": "1"}}
    apiserver.create_pod(
        {
            "metadata": {"name": "whole"},
            "spec": {"nodeName": NODE, "containers": [{"name": "m", "resources": limits}]},
        }
    )
    pods = PodClaims(apiserver.store)
    [obj] = pods.admit("default", "whole", NODE)
    assert obj["metadata"]["annotations"] == {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"}
    assert claim_shares(obj, NODE)[0].cores == 100
    validate(obj)
    status = (apiserver.pod("default", "whole") or {})["status"]["extendedResourceClaimStatus"]
    assert status["resourceClaimName"] == obj["metadata"]["name"]
    three = {"limits": {"gpu.vcuda.io/gpu": "3"}}
    apiserver.create_pod(
        {
            "metadata": {"name": "three"},
            "spec": {"nodeName": NODE, "containers": [{"name": "m", "resources": three}]},
        }
    )
    with pytest.raises(DraAllocationError, match="needs 3 device"):
        pods.admit("default", "three", NODE)
    assert len(apiserver.objects("resourceclaims")) == 1, "the misfit's claim is deleted again"
    assert "extendedResourceClaimStatus" not in (apiserver.pod("default", "three") or {})["status"]


def test_the_shipped_class_and_example_are_valid_136_objects() -> None:
    validate(device_class())
    for doc in load_yaml(EXAMPLE):  # a Pod's resourceClaims took this shape in 1.31
        validate(doc, DRA_SCHEMA_VERSIONS)


def test_a_pod_whose_template_is_missing_is_refused_clearly(apiserver: FakeApiServer) -> None:
    claims = [{"name": "gpu", "resourceClaimTemplateName": "none"}]
    apiserver.create_pod(
        {"metadata": {"name": "p"}, "spec": {"resourceClaims": claims, "containers": [{"name": "m"}]}}
    )
    with pytest.raises(DraAllocationError, match="resourceclaimtemplates default/none"):
        PodClaims(apiserver.store).admit("default", "p", NODE)
    with pytest.raises(DraAllocationError, match="pods default/ghost"):
        PodClaims(apiserver.store).admit("default", "ghost", NODE)
