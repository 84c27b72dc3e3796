"""The fake API server's store: resourceVersions, preconditions, history, watches, defaulting."""

from __future__ import annotations

from typing import Any

import pytest

from agent.emulators.apiserver_objects import pod_status, qos_class, zero_extended_resources
from agent.emulators.apiserver_query import ApiStatusError, Selector
from agent.emulators.apiserver_store import Store


def pod(name: str, node: str = "n1", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta}, "spec": {"nodeName": node, "containers": [{"name": "c"}]}}


def names(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    return [(kind, obj["metadata"].get("name", obj.get("code"))) for kind, obj in events]


def test_writes_bump_one_resource_version_and_no_ops_do_not() -> None:
    store = Store()
    a = store.create("pods", "default", pod("a"))
    node = store.create("nodes", "ignored", {"metadata": {"name": "n1", "namespace": "x"}})
    assert "namespace" not in node["metadata"] and node["kind"] == "Node"
    assert int(node["metadata"]["resourceVersion"]) == int(a["metadata"]["resourceVersion"]) + 1
    same = store.update("pods", "default", "a", lambda cur: cur)
    assert same is store.get("pods", "default", "a")
    assert store.resource_version == int(node["metadata"]["resourceVersion"])


def test_update_keeps_identity_and_checks_preconditions() -> None:
    store = Store()
    a = store.create("pods", "default", pod("a"))

    def rename(cur: dict[str, Any]) -> dict[str, Any]:
        cur["metadata"].update(name="b", uid="forged", labels={"x": "1"})
        return cur

    renamed = store.update("pods", "default", "a", rename)
    assert renamed["metadata"]["name"] == "a" and renamed["metadata"]["uid"] == a["metadata"]["uid"]
    assert renamed["metadata"]["labels"] == {"x": "1"}

    def stale(cur: dict[str, Any]) -> dict[str, Any]:
        cur["metadata"]["resourceVersion"] = a["metadata"]["resourceVersion"]
        return cur

    with pytest.raises(ApiStatusError) as caught:
        store.update("pods", "default", "a", stale)
    assert caught.value.code == 409
    with pytest.raises(ApiStatusError) as missing:
        store.update("pods", "default", "zz", lambda cur: cur)
    assert missing.value.code == 404
    with pytest.raises(ApiStatusError) as wrong_uid:
        store.delete("pods", "default", "a", uid="other")
    assert wrong_uid.value.code == 409


def test_status_is_written_only_through_the_subresource() -> None:
    store = Store()
    store.create("pods", "default", pod("a"))
    main = store.update("pods", "default", "a", lambda cur: {**cur, "status": {"phase": "Running"}})
    assert main["status"]["phase"] == "Pending"
    sub = store.update(
        "pods", "default", "a", lambda cur: {**cur, "status": {"phase": "Running"}, "spec": {}}, "status"
    )
    assert sub["status"]["phase"] == "Running" and sub["spec"]["nodeName"] == "n1"


def test_watch_replays_history_and_filters() -> None:
    store = Store()
    start = str(store.resource_version)
    store.create("pods", "default", pod("a"))
    store.create("pods", "default", pod("b", node="n2"))
    store.create("nodes", None, {"metadata": {"name": "n1"}})
    watcher = store.watch("pods", None, Selector("spec.nodeName=n1"), start)
    events, state = store.next_events(watcher, 0)
    assert names(events) == [("ADDED", "a")] and state == "open"
    store.update("pods", "default", "b", lambda cur: {**cur, "spec": {"nodeName": "n1"}})  # moves in
    store.delete("pods", "default", "a")
    events, _ = store.next_events(watcher, 0)
    assert names(events) == [("ADDED", "b"), ("DELETED", "a")]
    assert store.bookmark_rv(watcher) == str(store.resource_version)
    store.unwatch(watcher)
    assert store.open_watches() == 0


def test_compaction_expires_old_versions_and_open_watches() -> None:
    store = Store()
    old = str(store.resource_version)
    store.create("pods", "default", pod("a"))
    watcher = store.watch("pods", "default", Selector(), str(store.resource_version))
    store.compact()
    late = store.watch("pods", None, Selector(), old)
    events, state = store.next_events(late, 0)
    assert state == "finished" and events[0][0] == "ERROR" and events[0][1]["code"] == 410
    assert not store.watch("pods", None, Selector(), str(store.resource_version)).queue  # not older: fine
    store.create("pods", "default", pod("b"))
    events, state = store.next_events(watcher, 0)
    assert [e[0] for e in events] == ["ERROR"] and state == "finished"
    with pytest.raises(ApiStatusError) as caught:
        store.list_items("pods", None, Selector(), old, "Exact")
    assert caught.value.code == 410


def test_exact_list_reconstructs_past_state() -> None:
    store = Store()
    store.create("pods", "default", pod("a"))
    at = str(store.resource_version)
    store.update(
        "pods", "default", "a", lambda cur: {**cur, "metadata": {**cur["metadata"], "labels": {"v": "2"}}}
    )
    store.create("pods", "default", pod("b"))
    store.delete("pods", "default", "a")
    items, rv = store.list_items("pods", None, Selector(), at, "Exact")
    assert rv == at and [(i["metadata"]["name"], i["metadata"].get("labels")) for i in items] == [("a", None)]
    items, rv = store.list_items("pods", None, Selector())
    assert [i["metadata"]["name"] for i in items] == ["b"] and rv == str(store.resource_version)


def test_history_limit() -> None:
    store = Store(history_limit=2)
    start = str(store.resource_version)
    for name in "abc":
        store.create("pods", "default", pod(name))
    events, _ = store.next_events(store.watch("pods", None, Selector(), start), 0)
    assert events[0][0] == "ERROR"
    events, _ = store.next_events(store.watch("pods", None, Selector(), str(store.resource_version - 2)), 0)
    assert names(events) == [("ADDED", "b"), ("ADDED", "c")]


@pytest.mark.parametrize(
    ("fields", "labels", "matches"),
    [
        ("spec.nodeName=n1", "", True),
        ("spec.nodeName==n1,metadata.name!=a", "", False),
        ("status.phase!=Running", "", True),
        ("", "app=x", True),
        ("", "app!=x", False),
        ("", "app", True),
        ("", "!app", False),
        ("", "missing!=x", True),
        ("spec.missing=", "", True),
    ],
)
def test_selectors(fields: str, labels: str, matches: bool) -> None:
    obj = {
        "metadata": {"name": "a", "labels": {"app": "x"}},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Pending"},
    }
    assert Selector(fields, labels).matches(obj) is matches


@pytest.mark.parametrize(("fields", "labels"), [("spec.nodeName", ""), ("", "app in (x,y)")])
def test_unsupported_selectors_are_bad_requests(fields: str, labels: str) -> None:
    with pytest.raises(ApiStatusError) as caught:
        Selector(fields, labels)
    assert caught.value.code == 400


def test_qos_class() -> None:
    def with_resources(*resources: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(resources)]}}

    guaranteed = {"limits": {"cpu": "1", "memory": "1Gi"}}
    assert qos_class(with_resources(guaranteed, guaranteed)) == "Guaranteed"
    assert qos_class(with_resources(guaranteed, {})) == "Burstable"
    assert qos_class(with_resources({"requests": {"cpu": "1"}})) == "Burstable"
    assert (
        qos_class(with_resources({"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m"}}))
        == "Burstable"
    )
    assert qos_class(with_resources({"limits": {"nvidia.com/vcuda-core": "50"}})) == "BestEffort"


def test_pod_status_and_zeroing() -> None:
    spec = {
        "spec": {"initContainers": [{"name": "init"}], "containers": [{"name": "main"}]},
        "status": {"qosClass": "BestEffort"},
    }
    status = pod_status(spec, "Running", {"main": "abc", "init": "docker://def"})
    assert status["qosClass"] == "BestEffort" and status["phase"] == "Running"
    assert status["containerStatuses"][0]["containerID"] == "containerd://abc"
    assert status["initContainerStatuses"][0]["containerID"] == "docker://def"
    assert "running" in status["containerStatuses"][0]["state"]
    node = {"status": {"capacity": {"cpu": "4", "nvidia.com/vcuda-memory": "100", "kubernetes.io/x": "1"}}}
    zeroed = zero_extended_resources(node)
    assert zeroed["capacity"] == {"cpu": "4", "nvidia.com/vcuda-memory": "0", "kubernetes.io/x": "1"}
    assert node["status"]["capacity"]["nvidia.com/vcuda-memory"] == "100"
