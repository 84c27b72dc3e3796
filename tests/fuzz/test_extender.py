"""The scheduler extender's request bodies (ExtenderArgs, ExtenderBindingArgs) as hostile bytes.

Property: each verb answers a JSON-serialisable value of the protocol's shape, or raises
WireError (HTTP 400) whose message names the part of the body that is wrong; nothing else
escapes (the server would answer 500 and log a traceback per request).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agent.clock import VirtualClock
from agent.control.extenderbind import Binder
from agent.control.extenderview import ExtenderView
from agent.domain.clusterbook import ClusterBook
from agent.errors import KubeError
from agent.platform.kube.pods import PodInfo, pod_from_json
from agent.surfaces.extender import wire
from agent.surfaces.extender.service import ExtenderService
from tests.fuzz.strategies import DEEP, Mutation, deep_json, json_bytes, json_values, mutations, raw_bytes
from tests.fuzz.tally import count

PAYLOADS = Path(__file__).parents[1] / "integration" / "extender_payloads"
PODS = {p.stem: json.loads(p.read_text()) for p in sorted(PAYLOADS.glob("pod_*.json"))}
NODELIST = json.loads((PAYLOADS / "nodelist.json").read_text())
NODE_NAMES = [item["metadata"]["name"] for item in NODELIST["items"]]
SHARE = PODS["pod_share50"]
BINDING = {
    "podName": SHARE["metadata"]["name"],
    "podNamespace": SHARE["metadata"]["namespace"],
    "podUID": SHARE["metadata"]["uid"],
    "node": NODE_NAMES[0],
}
# The smallest pod the service parses (it names a GPU resource): short failure reports.
TINY_POD = {
    "metadata": {"name": "p", "uid": "u"},
    "spec": {
        "containers": [
            {
                "name": "c",
                "resources": {"limits": {"nvidia.com/vcuda-core": "50", "nvidia.com/vcuda-memory": "1000"}},
            }
        ]
    },
}
NOW = datetime.fromisoformat("2026-11-22T10:00:10+00:00").timestamp()  # the payloads' heartbeat + 10 s


class FakePods:
    """The API side of bind: the pod of the real payload; writes succeed and are dropped."""

    def get(self, namespace: str, name: str) -> PodInfo:
        if (namespace, name) != (BINDING["podNamespace"], BINDING["podName"]):
            raise KubeError(f'pods "{name}" not found', 404)
        return pod_from_json(SHARE)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        pass

    def patch_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> PodInfo:
        return self.get(namespace, name)


def service() -> ExtenderService:
    """A fresh extender per case (state from one case must not explain another's failure),
    knowing the payload's nodes as its Node watch would."""
    view = ExtenderView(ClusterBook(), clock=VirtualClock(NOW))
    for item in NODELIST["items"]:
        view.on_node_event("ADDED", item)
    view.mark_synced("nodes")
    view.mark_synced("pods")
    return ExtenderService(view, Binder(view, FakePods()))


def answer(verb: str, body: bytes) -> Any:
    """The verb's answer, checked for the protocol's shape; WireError passes through."""
    ext = service()
    if verb == "filter":
        result: Any = ext.filter(body)
        assert isinstance(result, dict)
        assert isinstance(result["failedNodes"], dict)
        assert isinstance(result["failedAndUnresolvableNodes"], dict)
        assert isinstance(result.get("nodenames", []), list)
    elif verb == "prioritize":
        result = ext.prioritize(body)
        assert all(isinstance(h["host"], str) and 0 <= h["score"] <= wire.MAX_PRIORITY for h in result)
    else:
        result = ext.bind(body)
        assert set(result) <= {"error"}
    json.dumps(result)  # what the server writes back must serialise
    return result


def check(verb: str, body: bytes, mutation: Mutation | None = None) -> None:
    count(f"extender.{verb}")
    try:
        answer(verb, body)
    except wire.WireError as err:
        assert str(err)
        if mutation is not None and mutation.path:
            # One part of a valid body changed: the message names that part.
            assert str(mutation.path[0]) in str(err), (mutation.path, str(err))


VERBS = ["filter", "prioritize", "bind"]
bodies = st.one_of(
    raw_bytes,
    json_bytes,
    deep_json.map(str.encode),
    json_values.map(lambda v: json.dumps({"pod": v, "nodenames": NODE_NAMES}).encode()),
    st.fixed_dictionaries(
        {}, optional={"pod": json_values, "nodes": json_values, "nodenames": json_values}
    ).map(lambda d: json.dumps(d).encode()),
)


@pytest.mark.parametrize("verb", VERBS)
@given(body=bodies)
@example(body=DEEP.encode())  # json.loads: RecursionError
@example(body=b'{"pod": {}, "nodes": {"items": [{"metadata": "x"}]}}')  # metadata not an object
@example(body=b"\xff\xfe\x00")  # not UTF-anything
def test_any_body(verb: str, body: bytes) -> None:
    check(verb, body)


def args_body(pod: str, nodes_mode: bool) -> dict[str, Any]:
    if nodes_mode:
        return {"pod": PODS[pod], "nodes": NODELIST}
    return {"pod": PODS[pod], "nodenames": NODE_NAMES}


@st.composite
def mutated_args(draw: st.DrawFn) -> Mutation:
    doc = args_body(draw(st.sampled_from(sorted(PODS))), draw(st.booleans()))
    return draw(mutations(doc))


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@given(mutation=mutated_args())
@example(  # a Node whose annotations are not an object
    mutation=Mutation(
        {"pod": TINY_POD, "nodes": {"items": [{"metadata": {"name": "n", "annotations": ["x"]}}]}},
        ("nodes",),
        False,
    )
)
def test_mutated_args(verb: str, mutation: Mutation) -> None:
    check(verb, json.dumps(mutation.doc).encode(), mutation)


@given(mutation=mutations(BINDING))
def test_mutated_binding(mutation: Mutation) -> None:
    check("bind", json.dumps(mutation.doc).encode(), mutation)


@given(key=st.sampled_from(sorted(BINDING)), value=json_values)
def test_binding_field_named(key: str, value: Any) -> None:
    # Every value that is not a non-empty string is refused naming exactly that field.
    count("extender.bind")
    body = json.dumps({**BINDING, key: value}).encode()
    if isinstance(value, str) and value:
        answer("bind", body)
        return
    with pytest.raises(wire.WireError, match=f"ExtenderBindingArgs.{key} "):
        answer("bind", body)


def test_real_payloads_answer() -> None:
    # The unmutated payloads are valid: the properties above start from working documents.
    for pod in PODS:
        for nodes_mode in (False, True):
            result = answer("filter", json.dumps(args_body(pod, nodes_mode)).encode())
            assert bool(result["failedAndUnresolvableNodes"]) == (pod == "pod_invalid_150"), result
    assert answer("bind", json.dumps(BINDING).encode()) == {}
