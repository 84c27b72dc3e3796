"""The fake API server's resource.k8s.io/v1 kinds, driven by the real kubernetes client's
ResourceV1Api (typed models: the JSON must deserialize as real objects) at the real paths."""

from __future__ import annotations

import json
from typing import Any

import pytest
import urllib3
from kubernetes import watch
from kubernetes.client import ApiClient, ResourceV1Api
from kubernetes.client.exceptions import ApiException

from agent.emulators.apiserver import FakeApiServer
from tests.integration.kubeapi import apiserver, kube
from tests.unit.drafixtures import claim, device_class, node_slice

__all__ = ["apiserver", "kube"]  # fixtures

Client = Any  # the typed client, used untyped (see test_apiserver.py)
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
def resource(kube: ApiClient) -> Client:
    return ResourceV1Api(kube)


def test_cluster_scoped_kinds_round_trip_typed(apiserver: FakeApiServer, resource: Client) -> None:
    created = resource.create_device_class(device_class())
    assert created.api_version == "resource.k8s.io/v1" and created.kind == "DeviceClass"
    assert created.spec.extended_resource_name == "gpu.vcuda.io/gpu"
    assert created.metadata.namespace is None and created.metadata.uid
    published = resource.create_resource_slice(node_slice())
    device = published.spec.devices[0]
    assert device.allow_multiple_allocations is True
    assert device.capacity["cores"].request_policy.valid_range.step == "1"
    assert device.attributes["index"].int == 0
    listed = resource.list_resource_slice(field_selector="spec.nodeName=gpu-node-1,spec.driver=gpu.vcuda.io")
    assert [s.metadata.name for s in listed.items] == ["gpu-node-1-gpu.vcuda.io"]
    assert resource.list_resource_slice(field_selector="spec.driver=other").items == []
    raw = json.loads(resource.list_resource_slice(_preload_content=False).data)
    assert (raw["kind"], raw["apiVersion"]) == ("ResourceSliceList", "resource.k8s.io/v1")
    resource.delete_resource_slice("gpu-node-1-gpu.vcuda.io")
    assert apiserver.objects("resourceslices") == []


def test_claims_have_a_status_subresource_and_a_create_drops_status(
    apiserver: FakeApiServer, resource: Client
) -> None:
    manifest = claim("c", cores="30")
    manifest["status"] = {"allocation": {"devices": {"results": []}}}
    manifest["metadata"].pop("uid")
    created = resource.create_namespaced_resource_claim("default", manifest)
    assert created.status is None, "status is the scheduler's to write"
    status = {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}}
    ignored = resource.patch_namespaced_resource_claim("c", "default", status)
    assert ignored.status is None, "a write to the object ignores status"
    patched = resource.patch_namespaced_resource_claim_status("c", "default", status)
    assert patched.status.reserved_for[0].name == "p"
    ops = [
        {"op": "replace", "path": "/spec/devices/requests/0/exactly/capacity/requests/cores", "value": "40"}
    ]
    spec_patch = resource.patch_namespaced_resource_claim("c", "default", ops, _content_type=JSON_PATCH)
    assert spec_patch.spec.devices.requests[0].exactly.capacity.requests == {"cores": "40"}
    assert spec_patch.status.reserved_for[0].name == "p", "a spec write keeps the status"
    stale = {"metadata": {"resourceVersion": created.metadata.resource_version}, "status": {}}
    with pytest.raises(ApiException) as caught:
        resource.patch_namespaced_resource_claim_status("c", "default", stale)
    assert caught.value.status == 409


def test_templates_are_namespaced(apiserver: FakeApiServer, resource: Client) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "share-30"},
        "spec": {"spec": claim("x", cores="30")["spec"]},
    }
    created = resource.create_namespaced_resource_claim_template("team", template)
    assert created.metadata.namespace == "team" and created.kind == "ResourceClaimTemplate"
    assert [t.metadata.name for t in resource.list_resource_claim_template_for_all_namespaces().items] == [
        "share-30"
    ]
    assert resource.list_namespaced_resource_claim_template("default").items == []


def test_slices_can_be_watched(apiserver: FakeApiServer, resource: Client) -> None:
    apiserver.create_object("resourceslices", node_slice())
    helper: Any = watch.Watch()  # type: ignore[no-untyped-call]
    stream = helper.stream(resource.list_resource_slice, resource_version="0", timeout_seconds=1)
    events = [(e["type"], e["object"].metadata.name) for e in stream]
    assert events == [("ADDED", "gpu-node-1-gpu.vcuda.io")]


def test_wrong_group_version_or_scope_is_not_found(apiserver: FakeApiServer) -> None:
    http = urllib3.PoolManager()
    for path in (
        "/api/v1/resourceslices",  # the core group has no such resource
        "/apis/resource.k8s.io/v1beta2/resourceslices",  # a version this server does not serve
        "/apis/resource.k8s.io/v1/namespaces/default/resourceslices",  # cluster-scoped
        "/apis/apps/v1/pods",
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates/t/status",  # no status
    ):
        response = http.request("GET", apiserver.url + path)
        assert response.status == 404, path
        assert json.loads(response.data)["reason"] == "NotFound"
    assert http.request("GET", apiserver.url + "/api/v1/pods").status == 200
