"""PodWriter, NodeClient, NodeWatch and EventRecorder through the real kubernetes client
against the fake API server over HTTP."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kubernetes.client import ApiClient, CoreV1Api, V1Node

from agent.clock import VirtualClock
from agent.emulators.apiserver import FakeApiServer
from agent.errors import ConflictError, KubeError
from agent.platform.kube.events import EventRecorder
from agent.platform.kube.nodes import NodeClient, NodeWatch
from agent.platform.kube.pods import pod_from_json
from agent.platform.kube.podwriter import PodWriter
from tests.integration.kubeapi import NODE, apiserver, core, kube, pod_manifest, running, wait_until

__all__ = ["apiserver", "core", "kube"]  # fixtures

MEMORY = "nvidia.com/vcuda-memory"


# -- PodWriter -------------------------------------------------------------------------------


def test_patch_annotations_adds_and_deletes(apiserver: FakeApiServer, kube: ApiClient) -> None:
    apiserver.create_pod(pod_manifest("p", annotations={"keep": "1", "drop": "2"}))
    writer = PodWriter(kube)
    pod = writer.patch_annotations("default", "p", {"nvidia.com/gpu-assigned": "true", "drop": None})
    assert dict(pod.annotations) == {"keep": "1", "nvidia.com/gpu-assigned": "true"}
    stored = apiserver.pod("default", "p") or {}
    assert stored["metadata"]["annotations"] == dict(pod.annotations)
    assert pod.resource_version == stored["metadata"]["resourceVersion"]


def test_patch_with_stale_resource_version_conflicts(apiserver: FakeApiServer, kube: ApiClient) -> None:
    created = apiserver.create_pod(pod_manifest("p"))
    writer = PodWriter(kube)
    rv = created["metadata"]["resourceVersion"]
    first = writer.patch_annotations("default", "p", {"a": "1"}, resource_version=rv)
    with pytest.raises(ConflictError) as caught:
        writer.patch_annotations("default", "p", {"a": "2"}, resource_version=rv)
    assert caught.value.status == 409 and 'pods "p"' in str(caught.value)
    assert (apiserver.pod("default", "p") or {})["metadata"]["annotations"] == {"a": "1"}
    again = writer.patch_annotations("default", "p", {"a": "2"}, resource_version=first.resource_version)
    assert again.annotations["a"] == "2"


def test_patch_of_a_missing_pod_is_404(kube: ApiClient) -> None:
    with pytest.raises(KubeError) as caught:
        PodWriter(kube).patch_annotations("default", "nope", {"a": "1"})
    assert caught.value.status == 404 and not isinstance(caught.value, ConflictError)
    assert "default/nope" in str(caught.value)


def test_server_errors_and_unreachable_server_become_kube_errors(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    apiserver.create_pod(pod_manifest("p"))
    apiserver.fail_next(1, 500)
    with pytest.raises(KubeError) as caught:
        PodWriter(kube).patch_annotations("default", "p", {"a": "1"})
    assert caught.value.status == 500
    apiserver.stop()
    with pytest.raises(KubeError) as unreachable:
        PodWriter(kube, request_timeout_s=2).patch_annotations("default", "p", {"a": "1"})
    assert unreachable.value.status is None and "did not answer" in str(unreachable.value)


def test_bind_sets_the_node_once(apiserver: FakeApiServer, kube: ApiClient) -> None:
    created = apiserver.create_pod(pod_manifest("p", node=None))
    writer = PodWriter(kube)
    writer.bind("default", "p", created["metadata"]["uid"], NODE)
    assert (apiserver.pod("default", "p") or {})["spec"]["nodeName"] == NODE
    with pytest.raises(ConflictError, match="already assigned"):
        writer.bind("default", "p", created["metadata"]["uid"], "gpu-node-2")
    apiserver.create_pod(pod_manifest("q", node=None))
    with pytest.raises(ConflictError, match="UID in precondition"):
        writer.bind("default", "q", "not-its-uid", NODE)


# -- NodeClient --------------------------------------------------------------------------------


def test_extended_resources_go_to_capacity_and_allocatable_only(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    apiserver.create_node(NODE, labels={"zone": "a"}, annotations={"note": "x"})
    nodes = NodeClient(kube, NODE)
    nodes.patch_extended_resources({MEMORY: "163840"})
    node = nodes.get()
    assert node["status"]["capacity"][MEMORY] == "163840"
    assert node["status"]["allocatable"][MEMORY] == "163840"
    assert node["status"]["capacity"]["cpu"] == "16"  # the rest is untouched
    assert node["metadata"]["labels"]["zone"] == "a" and node["metadata"]["annotations"] == {"note": "x"}
    nodes.patch_extended_resources({MEMORY: "81920"})  # "add" replaces an existing key
    assert nodes.get()["status"]["capacity"][MEMORY] == "81920"


def test_metadata_patch_does_not_touch_status(
    apiserver: FakeApiServer, kube: ApiClient, core: CoreV1Api
) -> None:
    apiserver.create_node(NODE, labels={"zone": "a", "old": "1"})
    nodes = NodeClient(kube, NODE)
    nodes.patch_extended_resources({MEMORY: "1000"})
    nodes.patch_metadata({"nvidia.com/gpu.count": "2", "old": None}, {"nvidia.com/vcuda-inventory": "{}"})
    node = nodes.get()
    assert node["metadata"]["labels"] == {
        "kubernetes.io/hostname": NODE,
        "zone": "a",
        "nvidia.com/gpu.count": "2",
    }
    assert node["metadata"]["annotations"]["nvidia.com/vcuda-inventory"] == "{}"
    assert node["status"]["capacity"][MEMORY] == "1000"
    # As on the real server, a PATCH of nodes/<n> ignores status: capacity needs nodes/<n>/status.
    core.patch_node(
        NODE, {"status": {"capacity": {MEMORY: "5"}}}, _content_type="application/merge-patch+json"
    )
    assert nodes.get()["status"]["capacity"][MEMORY] == "1000"


def test_zeroed_extended_resources_can_be_re_asserted(apiserver: FakeApiServer, kube: ApiClient) -> None:
    apiserver.create_node(NODE)
    nodes = NodeClient(kube, NODE)
    nodes.patch_extended_resources({MEMORY: "1000", "nvidia.com/vcuda-core": "200"})
    zeroed = apiserver.zero_extended_resources(NODE)
    assert zeroed["status"]["capacity"][MEMORY] == "0" and zeroed["status"]["allocatable"][MEMORY] == "0"
    assert zeroed["status"]["capacity"]["cpu"] == "16"
    nodes.patch_extended_resources({MEMORY: "1000"})
    status = nodes.get()["status"]
    assert status["capacity"][MEMORY] == status["allocatable"][MEMORY] == "1000"


def test_node_without_status_maps_gets_a_merge_patch(core: CoreV1Api, kube: ApiClient) -> None:
    core.create_node(V1Node.model_validate({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
    nodes = NodeClient(kube, NODE)
    nodes.patch_extended_resources({MEMORY: "42"})
    status = nodes.get()["status"]
    assert status["capacity"] == {MEMORY: "42"} and status["allocatable"] == {MEMORY: "42"}


def test_get_of_a_missing_node_is_404(kube: ApiClient) -> None:
    with pytest.raises(KubeError) as caught:
        NodeClient(kube, "nope").get()
    assert caught.value.status == 404


# -- NodeWatch ---------------------------------------------------------------------------------


def test_node_watch_sees_changes(apiserver: FakeApiServer, kube: ApiClient) -> None:
    apiserver.create_node(NODE)
    apiserver.create_node("other-node")
    watch = NodeWatch(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)
    assert watch.current() is None
    with running(watch.run, "node-watch"):
        node = wait_until(watch.current, what="first list")
        assert node["metadata"]["name"] == NODE
        version = watch.version
        apiserver.zero_extended_resources("other-node")  # not our node: no change
        assert watch.wait_for_change(version, timeout_s=0.3) == version
        NodeClient(kube, NODE).patch_extended_resources({MEMORY: "7"})
        changed = watch.wait_for_change(version, timeout_s=10)
        assert changed > version
        assert (watch.current() or {})["status"]["capacity"][MEMORY] == "7"

        abort = threading.Event()
        threading.Timer(0.2, abort.set).start()
        started = time.monotonic()
        assert watch.wait_for_change(changed, timeout_s=30, abort=abort) == changed
        assert time.monotonic() - started < 5

        apiserver.delete_node(NODE)
        wait_until(lambda: watch.current() is None, what="node deletion seen")


# -- EventRecorder -----------------------------------------------------------------------------


def test_pod_events_are_created_then_aggregated(apiserver: FakeApiServer, kube: ApiClient) -> None:
    pod = pod_from_json(apiserver.create_pod(pod_manifest("p")))
    clock = VirtualClock(start=1_800_000_000.0)
    recorder = EventRecorder(kube, NODE, clock=clock)
    with running(recorder.run, "events"):
        recorder.pod(pod, "InvalidGPUAnnotation", "nvidia.com/vcuda-core-limit 'abc' is not a number")
        assert recorder.flush(10)
        clock.advance(60)
        recorder.pod(pod, "InvalidGPUAnnotation", "nvidia.com/vcuda-core-limit 'abc' is not a number")
        recorder.pod(pod, "Allocated", "GPU 0", warning=False)
        assert recorder.flush(10)
    events = {e["reason"]: e for e in apiserver.events("default")}
    assert set(events) == {"InvalidGPUAnnotation", "Allocated"}
    invalid = events["InvalidGPUAnnotation"]
    assert invalid["count"] == 2 and invalid["type"] == "Warning"
    assert invalid["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "default", "uid": pod.uid,
    }  # fmt: skip
    assert invalid["source"] == {"component": "vcuda-agent", "host": NODE}
    assert invalid["reportingComponent"] == "vcuda-agent" and invalid["reportingInstance"] == NODE
    assert invalid["firstTimestamp"].startswith("2027-01-15T08:00:00")
    assert invalid["lastTimestamp"].startswith("2027-01-15T08:01:00")
    assert events["Allocated"]["type"] == "Normal" and events["Allocated"]["count"] == 1
    assert recorder.stats.created == 2 and recorder.stats.aggregated == 1


def test_repeats_after_the_window_create_a_new_event(apiserver: FakeApiServer, kube: ApiClient) -> None:
    clock = VirtualClock()
    recorder = EventRecorder(kube, NODE, clock=clock)
    with running(recorder.run, "events"):
        recorder.node("GPUUnhealthy", "GPU 1: XID 79")
        assert recorder.flush(10)
        clock.advance(601)
        recorder.node("GPUUnhealthy", "GPU 1: XID 79")
        assert recorder.flush(10)
    events = apiserver.events("default")
    assert [e["count"] for e in events] == [1, 1]
    assert events[0]["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}


def test_failures_are_logged_and_dropped(
    apiserver: FakeApiServer, kube: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "agent.platform.kube.events")
    pod = pod_from_json(apiserver.create_pod(pod_manifest("p")))
    recorder = EventRecorder(kube, NODE)
    apiserver.fail_next(1, 500)
    with running(recorder.run, "events"):
        recorder.pod(pod, "Lost", "this one fails")
        recorder.pod(pod, "Kept", "this one is posted")
        assert recorder.flush(10)
    assert [e["reason"] for e in apiserver.events()] == ["Kept"]
    assert recorder.stats.failed == 1
    assert any("could not record event Lost on Pod default/p" in r.getMessage() for r in caplog.records)


def test_queue_is_bounded_and_recording_never_blocks(kube: ApiClient) -> None:
    recorder = EventRecorder(kube, NODE, max_queue=3)  # not running: nothing is posted
    started = time.monotonic()
    for i in range(10):
        recorder.node("Flood", f"message {i}")
    assert time.monotonic() - started < 0.5
    assert recorder.stats.dropped == 7
    assert not recorder.flush(0.1)
