"""The kube-scheduler extender v1 JSON: what is parsed, what is answered."""

from __future__ import annotations

import json

import pytest

from agent.surfaces.extender import wire

POD = {"metadata": {"name": "p", "uid": "u"}, "spec": {"containers": []}}


def node(name: str) -> dict[str, object]:
    return {"metadata": {"name": name, "resourceVersion": "7"}, "status": {"capacity": {"cpu": "4"}}}


def test_node_names_mode() -> None:
    args = wire.parse_args(json.dumps({"pod": POD, "nodes": None, "nodenames": ["a", "b"]}).encode())
    assert args.node_names == ("a", "b") and args.nodes is None
    result = wire.filter_result(args, ["b"], {"a": "full"})
    assert result == {"nodenames": ["b"], "failedNodes": {"a": "full"}, "failedAndUnresolvableNodes": {}}


def test_node_list_mode_answers_the_node_objects() -> None:
    body = {"pod": POD, "nodes": {"kind": "NodeList", "apiVersion": "v1", "items": [node("a"), node("b")]}}
    args = wire.parse_args(json.dumps(body).encode())
    assert args.node_names == ("a", "b") and args.nodes is not None
    result = wire.filter_result(args, ["b"], {"a": "full"})
    assert result["nodes"]["items"] == [node("b")] and "nodenames" not in result
    assert result["nodes"]["kind"] == "NodeList"
    assert wire.pass_through(args)["nodes"]["items"] == [node("a"), node("b")]


def test_unresolvable_fails_every_node() -> None:
    args = wire.parse_args(json.dumps({"pod": POD, "nodenames": ["a", "b"]}).encode())
    result = wire.unresolvable(args, "bad request")
    assert result["nodenames"] == []
    assert result["failedAndUnresolvableNodes"] == {"a": "bad request", "b": "bad request"}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"nope", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"nodenames": []}', "no pod"),
        (b'{"pod": {}}', "nodenames"),
        (b'{"pod": {}, "nodenames": [3]}', "nodenames"),
        (b'{"pod": {}, "nodes": {"items": [{"metadata": {}}]}}', "metadata.name"),
        (b'{"pod": {}, "nodes": []}', "NodeList"),
    ],
)
def test_malformed_args_say_what_is_wrong(body: bytes, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.parse_args(body)


def test_priority_list_is_in_request_order_and_clamped() -> None:
    assert wire.priority_list(["b", "a", "c"], {"a": 12, "b": -1}) == [
        {"host": "b", "score": 0},
        {"host": "a", "score": 10},
        {"host": "c", "score": 0},
    ]


def test_binding_args() -> None:
    body = {"podName": "p", "podNamespace": "ns", "podUID": "u", "node": "n"}
    assert wire.parse_binding(json.dumps(body).encode()) == wire.BindingArgs("p", "ns", "u", "n")
    with pytest.raises(wire.WireError, match="podUID"):
        wire.parse_binding(json.dumps({**body, "podUID": ""}).encode())
    assert wire.binding_result() == {} and wire.binding_result("no") == {"error": "no"}


def test_cheap_gpu_check() -> None:
    assert not wire.may_want_gpu(json.dumps({"pod": POD}).encode())
    assert wire.may_want_gpu(b'{"limits": {"nvidia.com/vcuda-memory": "1"}}')
    assert wire.may_want_gpu(b'{"limits": {"nvidia.com/vcuda-core": "1"}}')
