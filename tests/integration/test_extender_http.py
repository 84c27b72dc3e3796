"""The scheduler extender over real HTTP: filter and prioritize with payloads shaped as
kube-scheduler sends them, in both nodeCacheCapable modes, against nodes and pods in the
fake API server (watched by the extender's real caches)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.domain.annotations import PREDICATE_NODE, predicate_key
from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from tests.integration.extenderkit import (
    Extender,
    args_names,
    args_nodes,
    fresh_nodelist,
    get,
    gpu_pod,
    inventory_text,
    payload,
    post,
    running_extender,
)
from tests.integration.kubeapi import apiserver, wait_until

__all__ = ["apiserver"]
NODES = ["gpu-a", "gpu-b"]


@pytest.fixture
def nodelist(apiserver: FakeApiServer) -> dict[str, Any]:
    """The NodeList fixture (fresh heartbeats), its nodes also created in the API server."""
    nodes = fresh_nodelist()
    for item in nodes["items"]:
        meta = item["metadata"]
        apiserver.create_node(meta["name"], labels=meta["labels"], annotations=meta["annotations"])
    return nodes


@pytest.fixture
def extender(apiserver: FakeApiServer, nodelist: dict[str, Any], tmp_path: Path) -> Iterator[Extender]:
    with running_extender(apiserver, apiserver.write_kubeconfig(tmp_path / "kc")) as ext:
        yield ext


def place(apiserver: FakeApiServer, name: str, node: str, cores: int, memory: int, *, gpu: int) -> None:
    """A pod already running on ``node`` with its GPU annotated (as bind or the agent leaves it)."""
    annotations = {predicate_key(0, False): str(gpu), PREDICATE_NODE: node}
    apiserver.create_pod(gpu_pod(name, cores, memory, node=node, annotations=annotations))


def test_filter_with_node_objects_answers_node_objects(extender: Extender, nodelist: dict[str, Any]) -> None:
    status, result = post(extender.url, "filter", args_nodes(payload("pod_share50.json"), nodelist))
    assert status == 200
    assert [n["metadata"]["name"] for n in result["nodes"]["items"]] == NODES
    assert result["nodes"]["items"] == nodelist["items"]  # the Node objects come back untouched
    assert "nodenames" not in result and result["failedNodes"] == {}
    assert not result.get("error")


def test_filter_with_node_names_answers_node_names(extender: Extender) -> None:
    status, result = post(extender.url, "filter", args_names(payload("pod_share50.json"), NODES))
    assert status == 200
    assert result["nodenames"] == NODES and "nodes" not in result
    assert result["failedNodes"] == {} and result["failedAndUnresolvableNodes"] == {}


def test_node_objects_in_the_request_are_used(extender: Extender, nodelist: dict[str, Any]) -> None:
    # The request's Node is newer than what the watch saw: its (unhealthy) GPUs count.
    node = nodelist["items"][0]
    node["metadata"]["resourceVersion"] = "99999999"
    node["metadata"]["annotations"][INVENTORY_ANNOTATION] = inventory_text("gpu-a", 2, unhealthy=(0, 1))
    status, result = post(extender.url, "filter", args_nodes(payload("pod_share50.json"), nodelist))
    assert status == 200
    assert [n["metadata"]["name"] for n in result["nodes"]["items"]] == ["gpu-b"]
    assert "healthy" in result["failedNodes"]["gpu-a"]


@pytest.mark.parametrize("mode", ["nodes", "nodenames"])
def test_pods_without_vcuda_resources_pass_through(
    extender: Extender, nodelist: dict[str, Any], mode: str
) -> None:
    pod = payload("pod_cpu_only.json")
    unmanaged = {"metadata": {"name": "cpu-only-node", "resourceVersion": "1"}, "status": {}}
    nodes = {**nodelist, "items": [*nodelist["items"], unmanaged]}
    names = [*NODES, "cpu-only-node", "never-heard-of"]
    body = args_nodes(pod, nodes) if mode == "nodes" else args_names(pod, names)
    status, result = post(extender.url, "filter", body)
    assert status == 200
    if mode == "nodes":
        assert result["nodes"]["items"] == nodes["items"]
    else:
        assert result["nodenames"] == names
    assert result["failedNodes"] == {} and result["failedAndUnresolvableNodes"] == {}
    status, scores = post(extender.url, "prioritize", body)
    expected = [n["metadata"]["name"] for n in nodes["items"]] if mode == "nodes" else names
    assert status == 200 and scores == [{"host": n, "score": 0} for n in expected]


def test_invalid_request_fails_every_node_unresolvably(extender: Extender) -> None:
    status, result = post(extender.url, "filter", args_names(payload("pod_invalid_150.json"), NODES))
    assert status == 200
    assert result["nodenames"] == [] and result["failedNodes"] == {}
    reasons = result["failedAndUnresolvableNodes"]
    assert sorted(reasons) == NODES
    assert all("150" in r for r in reasons.values()), reasons


def test_fractional_cores_without_memory_are_rejected_with_reason(extender: Extender) -> None:
    pod = payload("pod_share50.json")
    del pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/vcuda-memory"]
    del pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/vcuda-memory"]
    status, result = post(extender.url, "filter", args_names(pod, NODES))
    assert status == 200 and result["nodenames"] == []
    assert all("memory" in r for r in result["failedAndUnresolvableNodes"].values())


def test_fragmented_gpus_fail_a_share_that_fits_the_node_total(
    apiserver: FakeApiServer, extender: Extender
) -> None:
    # gpu-a: 70 cores used on each GPU, 60 free in total but 30 per GPU: 50 fits neither.
    place(apiserver, "a0", "gpu-a", 70, 1024, gpu=0)
    place(apiserver, "a1", "gpu-a", 70, 1024, gpu=1)
    wait_until(lambda: sum(u.cores_used for u in extender.view.gpu_usage("gpu-a")) == 140)
    status, result = post(extender.url, "filter", args_names(payload("pod_share50.json"), NODES))
    assert status == 200 and result["nodenames"] == ["gpu-b"]
    assert "gpu-a" in result["failedNodes"] and result["failedNodes"]["gpu-a"]


def test_exact_fit_and_one_mib_over(apiserver: FakeApiServer, extender: Extender) -> None:
    pod = payload("pod_share50.json")
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part]["nvidia.com/vcuda-memory"] = str(73403)
    assert post(extender.url, "filter", args_names(pod, ["gpu-a"]))[1]["nodenames"] == ["gpu-a"]
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part]["nvidia.com/vcuda-memory"] = str(73404)
    _, result = post(extender.url, "filter", args_names(pod, ["gpu-a"]))
    assert result["nodenames"] == []
    assert result["failedNodes"].get("gpu-a") or result["failedAndUnresolvableNodes"].get("gpu-a")


def test_stale_node_and_unhealthy_gpu_come_from_the_annotation(
    apiserver: FakeApiServer, extender: Extender
) -> None:
    stale = {INVENTORY_ANNOTATION: inventory_text("gpu-stale", 2, heartbeat=time.time() - 400)}
    sick = {INVENTORY_ANNOTATION: inventory_text("gpu-sick", 1, unhealthy=(0,))}
    apiserver.create_node("gpu-stale", annotations=stale)
    apiserver.create_node("gpu-sick", annotations=sick)
    apiserver.create_node("cpu-only")
    names = ["gpu-stale", "gpu-sick", "cpu-only", *NODES]

    def check() -> dict[str, Any] | None:
        result = post(extender.url, "filter", args_names(payload("pod_share50.json"), names))[1]
        seen = not any("not seen" in r for r in result["failedNodes"].values())
        return result if seen and len(result["failedNodes"]) == 3 else None

    result = wait_until(check, what="three failed nodes")
    assert result["nodenames"] == NODES
    failed = result["failedNodes"]
    assert "stale" in failed["gpu-stale"] and "heartbeat" in failed["gpu-stale"]
    assert "healthy" in failed["gpu-sick"]
    assert INVENTORY_ANNOTATION in failed["cpu-only"]


def test_node_policy_binpack_and_spread_order_nodes(apiserver: FakeApiServer, extender: Extender) -> None:
    place(apiserver, "busy", "gpu-a", 50, 20480, gpu=0)
    wait_until(lambda: sum(u.cores_used for u in extender.view.gpu_usage("gpu-a")) == 50)
    pod = payload("pod_share50.json")
    _, scores = post(extender.url, "prioritize", args_names(pod, NODES))
    binpack = {s["host"]: s["score"] for s in scores}
    assert binpack["gpu-a"] > binpack["gpu-b"], binpack  # the extender's default: binpack
    pod["metadata"]["annotations"]["nvidia.com/vcuda-node-policy"] = "spread"
    _, scores = post(extender.url, "prioritize", args_names(pod, NODES))
    spread = {s["host"]: s["score"] for s in scores}
    assert spread["gpu-b"] > spread["gpu-a"], spread
    assert all(0 <= s <= 10 for s in (*binpack.values(), *spread.values()))


def test_malformed_requests_get_400_and_the_server_keeps_serving(extender: Extender) -> None:
    for body in (b"{not json", b"[]", b'{"pod": {}}', b'{"pod": {}, "nodenames": [1]}'):
        status, answer = post(extender.url, "filter", body)
        assert status == 400 and answer["error"], (body, answer)
    status, answer = post(extender.url, "bind", b'{"podName": "x"}')
    assert status == 400 and "podNamespace" in answer["error"]
    status, answer = post(extender.url, "preempt", b"{}")
    assert status == 404
    status, result = post(extender.url, "filter", args_names(payload("pod_share50.json"), NODES))
    assert status == 200 and result["nodenames"] == NODES


def test_health_readiness_and_metrics(extender: Extender) -> None:
    assert get(extender.url, "/healthz")[0] == 200
    assert get(extender.url, "/readyz")[0] == 200
    post(extender.url, "filter", args_names(payload("pod_share50.json"), NODES))
    status, text = get(extender.url, "/metrics")
    assert status == 200
    assert 'vcuda_extender_requests_total{code="200",verb="filter"}' in text
    assert "vcuda_extender_request_seconds_bucket" in text


def test_payload_fixtures_are_what_the_api_returns() -> None:
    # Guard against fixtures drifting from the real types (kube-scheduler sends a full Pod).
    for name in ("pod_share50.json", "pod_whole200.json", "pod_cpu_only.json", "pod_invalid_150.json"):
        pod = payload(name)
        assert pod["kind"] == "Pod" and pod["metadata"]["uid"] and pod["status"]["phase"] == "Pending"
    nodes = payload("nodelist.json")
    assert nodes["kind"] == "NodeList"
    assert all(json.loads(n["metadata"]["annotations"][INVENTORY_ANNOTATION]) for n in nodes["items"])


def test_a_failing_handler_costs_one_answer_not_the_server(extender: Extender) -> None:
    def boom(body: bytes) -> Any:
        raise RuntimeError("a bug")

    extender.server._verbs["filter"] = boom  # a bug in the service, simulated
    status, answer = post(extender.url, "filter", args_names(payload("pod_share50.json"), NODES))
    assert status == 500 and "RuntimeError: a bug" in answer["error"]
    status, scores = post(extender.url, "prioritize", args_names(payload("pod_share50.json"), NODES))
    assert status == 200 and [s["host"] for s in scores] == NODES
