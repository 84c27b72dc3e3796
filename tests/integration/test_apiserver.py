"""The fake API server, driven over HTTP by the real kubernetes client (typed models included,
so the JSON it serves must deserialize as real Kubernetes objects)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import watch
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException

from agent.emulators.apiserver import FakeApiServer
from agent.platform.kube.client import api_client
from tests.integration.kubeapi import NODE, apiserver, core, kube, pod_manifest, wait_until

__all__ = ["apiserver", "core", "kube"]  # fixtures

# The typed client, used untyped here: every field of its models is Optional, so strict
# typing of the assertions would be noise; what matters is that the JSON deserializes.
Client = Any
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def raw(response: Any) -> Any:
    return json.loads(response.data)


def status_of(err: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(err.body or "{}")
    return body


def test_created_pod_gets_server_defaults(core: Client) -> None:
    manifest = pod_manifest("p")
    manifest["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    pod = core.create_namespaced_pod("default", manifest)  # typed: V1Pod
    assert pod.kind == "Pod" and pod.api_version == "v1"
    assert re.fullmatch(r"[0-9a-f-]{36}", pod.metadata.uid)
    assert pod.metadata.creation_timestamp.tzinfo is not None
    assert int(pod.metadata.resource_version) > 0
    assert pod.status.phase == "Pending" and pod.status.qos_class == "Guaranteed"
    assert core.read_namespaced_pod("p", "default").metadata.uid == pod.metadata.uid

    best_effort = core.create_namespaced_pod("default", pod_manifest("q", cores=None))
    assert best_effort.status.qos_class == "BestEffort"
    burstable = pod_manifest("r")
    burstable["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "100m"}
    assert core.create_namespaced_pod("default", burstable).status.qos_class == "Burstable"

    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod("default", pod_manifest("p"))
    assert caught.value.status == 409 and status_of(caught.value)["reason"] == "AlreadyExists"


def test_list_filters_by_field_selector_and_namespace(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("a"))
    apiserver.create_pod(pod_manifest("b", node="gpu-node-2"))
    apiserver.create_pod(pod_manifest("c", namespace="team"))
    apiserver.set_pod_phase("default", "a", "Running")
    everything = core.list_pod_for_all_namespaces()
    assert [p.metadata.name for p in everything.items] == ["a", "b", "c"]
    assert everything.metadata.resource_version == str(apiserver.resource_version)
    mine = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}")
    assert [p.metadata.name for p in mine.items] == ["a", "c"]
    assert [p.metadata.name for p in core.list_namespaced_pod("team").items] == ["c"]
    running = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE},status.phase!=Pending")
    assert [p.metadata.name for p in running.items] == ["a"]
    named = core.list_pod_for_all_namespaces(field_selector="metadata.name=b")
    assert [p.metadata.name for p in named.items] == ["b"]


def test_every_write_bumps_one_global_resource_version(apiserver: FakeApiServer, core: Client) -> None:
    versions = [int(apiserver.create_pod(pod_manifest("a"))["metadata"]["resourceVersion"])]
    versions.append(int(apiserver.create_node(NODE)["metadata"]["resourceVersion"]))
    patched = core.patch_namespaced_pod(
        "a", "default", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE
    )
    versions.append(int(patched.metadata.resource_version))
    assert versions == sorted(versions) and len(set(versions)) == 3
    again = core.patch_namespaced_pod(
        "a", "default", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE
    )
    assert again.metadata.resource_version == patched.metadata.resource_version  # no-op: no write


def test_merge_and_strategic_patches(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("p", annotations={"a": "1", "b": "2"}))
    body = {"metadata": {"annotations": {"a": None, "c": "3"}}}
    pod = raw(core.patch_namespaced_pod("p", "default", body, _content_type=MERGE, _preload_content=False))
    assert pod["metadata"]["annotations"] == {"b": "2", "c": "3"}
    pod = raw(
        core.patch_namespaced_pod(
            "p", "default", {"metadata": {"labels": {"l": "v"}}}, _preload_content=False
        )
    )
    assert pod["metadata"]["labels"] == {"l": "v"}  # the client's default for a dict: strategic merge


def test_json_patch_operations_and_escapes(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("p", annotations={"nvidia.com/old": "1", "t~ilde": "x"}))
    ops = [
        {"op": "test", "path": "/metadata/annotations/nvidia.com~1old", "value": "1"},
        {"op": "add", "path": "/metadata/annotations/nvidia.com~1gpu-assigned", "value": "false"},
        {"op": "replace", "path": "/metadata/annotations/nvidia.com~1gpu-assigned", "value": "true"},
        {"op": "remove", "path": "/metadata/annotations/nvidia.com~1old"},
        {"op": "replace", "path": "/metadata/annotations/t~0ilde", "value": "y"},
    ]
    pod = raw(core.patch_namespaced_pod("p", "default", ops, _preload_content=False))
    assert pod["metadata"]["annotations"] == {"nvidia.com/gpu-assigned": "true", "t~ilde": "y"}
    failing = [{"op": "test", "path": "/metadata/annotations/nvidia.com~1gpu-assigned", "value": "false"}]
    with pytest.raises(ApiException) as caught:
        core.patch_namespaced_pod("p", "default", failing)
    assert caught.value.status == 422
    with pytest.raises(ApiException) as missing:
        core.patch_namespaced_pod("p", "default", [{"op": "remove", "path": "/metadata/labels/none"}])
    assert missing.value.status == 422


def test_resource_version_in_a_patch_is_a_precondition(apiserver: FakeApiServer, core: Client) -> None:
    rv = apiserver.create_pod(pod_manifest("p"))["metadata"]["resourceVersion"]
    core.patch_namespaced_pod(
        "p", "default", {"metadata": {"resourceVersion": rv, "labels": {"a": "1"}}}, _content_type=MERGE
    )
    with pytest.raises(ApiException) as caught:
        core.patch_namespaced_pod(
            "p", "default", {"metadata": {"resourceVersion": rv, "labels": {"a": "2"}}}, _content_type=MERGE
        )
    assert caught.value.status == 409
    status = status_of(caught.value)
    assert status["kind"] == "Status" and status["reason"] == "Conflict" and status["code"] == 409
    assert status["details"] == {"name": "p", "kind": "pods"}
    with pytest.raises(ApiException) as replaced:
        core.patch_namespaced_pod(
            "p", "default", [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv}]
        )
    assert replaced.value.status == 409


def test_status_subresource_is_separate(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("p"))
    pod = core.patch_namespaced_pod(
        "p",
        "default",
        {"status": {"phase": "Running"}, "metadata": {"labels": {"a": "1"}}},
        _content_type=MERGE,
    )
    assert pod.status.phase == "Pending" and pod.metadata.labels == {"a": "1"}
    pod = core.patch_namespaced_pod_status(
        "p",
        "default",
        {"status": {"phase": "Running"}, "metadata": {"labels": {"a": "2"}}},
        _content_type=MERGE,
    )
    assert pod.status.phase == "Running" and pod.metadata.labels == {"a": "1"}
    pod = apiserver.set_pod_phase("default", "p", "Succeeded", {"main": "cri-o://abc"})
    status = core.read_namespaced_pod_status("p", "default").status
    assert status.phase == "Succeeded" and status.container_statuses[0].container_id == "cri-o://abc"
    assert status.container_statuses[0].state.terminated.exit_code == 0


def test_binding_and_delete(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("p", node=None))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"kind": "Node", "name": NODE},
    }
    # Like the real server, a binding answers with a Status (which the client's typed return
    # value cannot hold: kubernetes-client/python#547), hence the raw response.
    answer = raw(core.create_namespaced_binding("default", binding, _preload_content=False))
    assert answer["kind"] == "Status" and answer["status"] == "Success" and answer["code"] == 201
    assert core.read_namespaced_pod("p", "default").spec.node_name == NODE
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod_binding("p", "default", binding)
    assert caught.value.status == 409
    deleted = raw(core.delete_namespaced_pod("p", "default", _preload_content=False))
    assert deleted["metadata"]["name"] == "p"
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("p", "default")
    assert gone.value.status == 404 and status_of(gone.value)["reason"] == "NotFound"


def test_watch_with_the_clients_watch_helper(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("existing"))
    start_rv = str(apiserver.resource_version)

    def writes() -> None:
        apiserver.create_pod(pod_manifest("new"))
        apiserver.set_pod_phase("default", "new", "Running")
        apiserver.delete_pod("default", "new")

    threading.Timer(0.2, writes).start()
    seen = []
    helper: Any = watch.Watch()  # type: ignore[no-untyped-call]
    stream = helper.stream(core.list_namespaced_pod, "default", resource_version=start_rv, timeout_seconds=2)
    for event in stream:
        seen.append((event["type"], event["object"].metadata.name, event["object"].status.phase))
        if event["type"] == "DELETED":
            break
    assert seen == [
        ("ADDED", "new", "Pending"),
        ("MODIFIED", "new", "Running"),
        ("DELETED", "new", "Running"),
    ]


def watch_lines(core: Client, **kwargs: Any) -> list[dict[str, Any]]:
    """Every event of one watch, read until the server ends the stream."""
    response = core.list_pod_for_all_namespaces(watch=True, _preload_content=False, **kwargs)
    return [json.loads(line) for line in b"".join(response.stream(decode_content=False)).splitlines() if line]


def test_watch_from_zero_replays_state_and_times_out(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_pod(pod_manifest("a"))
    apiserver.create_pod(pod_manifest("b", node="gpu-node-2"))
    events = watch_lines(
        core, resource_version="0", field_selector=f"spec.nodeName={NODE}", timeout_seconds=1
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a")]


def test_bookmarks_carry_the_current_resource_version(apiserver: FakeApiServer, core: Client) -> None:
    start = str(apiserver.resource_version)
    apiserver.create_pod(pod_manifest("elsewhere", node="gpu-node-2"))
    events = watch_lines(
        core,
        resource_version=start,
        field_selector=f"spec.nodeName={NODE}",
        allow_watch_bookmarks=True,
        timeout_seconds=1,
    )
    assert events and {e["type"] for e in events} == {"BOOKMARK"}
    assert events[0]["object"] == {
        "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(apiserver.resource_version)},
    }  # fmt: skip


def test_selector_transitions_are_added_and_deleted(apiserver: FakeApiServer, core: Client) -> None:
    start = str(apiserver.resource_version)
    apiserver.create_pod(pod_manifest("p", node=None))
    apiserver.store.update("pods", "default", "p", lambda p: {**p, "spec": {**p["spec"], "nodeName": NODE}})
    apiserver.patch_pod("default", "p", {"spec": {"nodeName": "gpu-node-2"}})
    events = watch_lines(
        core, resource_version=start, field_selector=f"spec.nodeName={NODE}", timeout_seconds=1
    )
    assert [e["type"] for e in events] == ["ADDED", "DELETED"]


def test_expired_resource_version_gives_410(apiserver: FakeApiServer, core: Client) -> None:
    old = str(apiserver.resource_version)
    apiserver.create_pod(pod_manifest("a"))
    apiserver.create_pod(pod_manifest("b"))
    middle = str(apiserver.resource_version - 1)
    exact = core.list_pod_for_all_namespaces(resource_version=middle, resource_version_match="Exact")
    assert [p.metadata.name for p in exact.items] == ["a"]  # served from the history
    apiserver.compact()
    events = watch_lines(core, resource_version=old, timeout_seconds=5)
    assert [e["type"] for e in events] == ["ERROR"]
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"
    with pytest.raises(ApiException) as caught:
        core.list_pod_for_all_namespaces(resource_version=old, resource_version_match="Exact")
    assert caught.value.status == 410
    assert (
        len(
            core.list_pod_for_all_namespaces(
                resource_version=old, resource_version_match="NotOlderThan"
            ).items
        )
        == 2
    )


def test_history_limit_expires_old_versions(tmp_path: Path) -> None:
    with FakeApiServer(history_limit=3) as small:
        client: Client = CoreV1Api(api_client(small.write_kubeconfig(tmp_path / "kc"), in_cluster=False))
        start = str(small.resource_version)
        for i in range(5):
            small.create_pod(pod_manifest(f"p{i}"))
        response = client.list_pod_for_all_namespaces(
            watch=True, resource_version=start, timeout_seconds=2, _preload_content=False
        )
        first = json.loads(next(iter(response.stream(decode_content=False))).splitlines()[0])
        response.release_conn()
        assert first["type"] == "ERROR" and first["object"]["code"] == 410
        recent = str(small.resource_version - 2)
        events = watch_lines(client, resource_version=recent, timeout_seconds=1)
        assert [e["object"]["metadata"]["name"] for e in events] == ["p3", "p4"]


def test_drop_watches_cuts_the_stream(apiserver: FakeApiServer, core: Client) -> None:
    response = core.list_pod_for_all_namespaces(
        watch=True, resource_version="0", timeout_seconds=30, _preload_content=False
    )
    wait_until(lambda: apiserver.open_watches("pods") == 1)
    threading.Timer(0.1, apiserver.drop_watches).start()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for _ in response.stream(decode_content=False):
            pass
    wait_until(lambda: apiserver.open_watches() == 0)


def test_injected_failures_and_request_log(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.fail_next(2, 503)
    for _ in range(2):
        with pytest.raises(ApiException) as caught:
            core.list_node()
        assert caught.value.status == 503
    assert core.list_node().items == []
    assert [(r.method, r.path, r.status) for r in apiserver.request_log] == [
        ("GET", "/api/v1/nodes", 503)
    ] * 2 + [("GET", "/api/v1/nodes", 200)]


def test_node_status_and_metadata_are_patched_separately(apiserver: FakeApiServer, core: Client) -> None:
    apiserver.create_node(NODE, labels={"a": "1"})
    ops = [{"op": "add", "path": "/status/capacity/nvidia.com~1vcuda-memory", "value": "100"}]
    node = core.patch_node_status(NODE, ops)  # typed: V1Node
    assert node.status.capacity["nvidia.com/vcuda-memory"] == "100"
    label_op = [{"op": "add", "path": "/metadata/labels/b", "value": "2"}]
    node = core.patch_node_status(NODE, label_op)
    assert "b" not in node.metadata.labels  # the status subresource changes status only
    node = core.patch_node(NODE, [*label_op, {"op": "add", "path": "/status/capacity/x~1y", "value": "1"}])
    assert node.metadata.labels["b"] == "2" and "x/y" not in node.status.capacity
    assert [n.metadata.name for n in core.list_node(field_selector=f"metadata.name={NODE}").items] == [NODE]


def test_events_resource(core: Client, apiserver: FakeApiServer) -> None:
    body = {
        "metadata": {"name": "e1"},
        "involvedObject": {"kind": "Pod", "name": "p"},
        "reason": "R",
        "count": 1,
    }
    core.create_namespaced_event("default", body)
    core.patch_namespaced_event("e1", "default", {"count": 2}, _content_type=MERGE)
    listed = core.list_namespaced_event("default").items
    assert [(e.metadata.name, e.count) for e in listed] == [("e1", 2)]
    assert [e["metadata"]["name"] for e in apiserver.events()] == ["e1"]
    assert core.list_event_for_all_namespaces().items[0].reason == "R"


def test_kubeconfig_and_version(apiserver: FakeApiServer, tmp_path: Path) -> None:
    client = api_client(apiserver.write_kubeconfig(tmp_path / "kc"), in_cluster=False)
    assert client.configuration.host == apiserver.url
    response = client.rest_client.pool_manager.request("GET", f"{apiserver.url}/version")
    assert json.loads(response.data)["major"] == "1"


def test_unknown_paths_and_bad_bodies(apiserver: FakeApiServer) -> None:
    http = urllib3.PoolManager()
    assert http.request("GET", f"{apiserver.url}/api/v1/secrets").status == 404
    assert http.request("GET", f"{apiserver.url}/api/v1/namespaces/x/nodes").status == 404
    bad = http.request(
        "POST",
        f"{apiserver.url}/api/v1/namespaces/default/pods",
        body=b"{nope",
        headers={"Content-Type": "application/json"},
    )
    assert bad.status == 400 and json.loads(bad.data)["reason"] == "BadRequest"
    apiserver.create_node("n")
    apply = http.request(
        "PATCH",
        f"{apiserver.url}/api/v1/nodes/n",
        body=b"{}",
        headers={"Content-Type": "application/apply-patch+yaml"},
    )
    assert apply.status == 415
