"""What the API server's watch stream delivers, line by line (agent/platform/kube/reflector.py):
a broken proxy or a buggy server can send anything. Property: each line is applied, ignored,
or refused with KubeError (the watch then restarts from its last resourceVersion); the
reflector's store keeps only objects, and nothing else escapes the watch thread."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from agent.errors import KubeError
from agent.platform.kube.reflector import Reflector
from tests.fuzz.strategies import DEEP, json_bytes, json_values, mutations, raw_bytes
from tests.fuzz.tally import count

POD_EVENT = {
    "type": "MODIFIED",
    "object": {
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"nodeName": "n"},
    },
}


def _reflector(seen: list[tuple[str, Any]]) -> Reflector:
    def list_nothing(**kwargs: Any) -> Any:
        raise AssertionError("the fuzz test only feeds lines")

    return Reflector(list_nothing, lambda kind, obj: seen.append((kind, obj)), "pods")


def feed(line: bytes) -> None:
    count("watch line")
    seen: list[tuple[str, Any]] = []
    reflector = _reflector(seen)
    try:
        reflector._on_line(line)
    except KubeError as err:
        assert "watch pods" in str(err)
        assert not seen
        return
    for kind, obj in seen:
        assert kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(obj, dict)


@given(st.one_of(raw_bytes, json_bytes))
@example(DEEP.encode())
@example(b'{"type": "ADDED", "object": {"metadata": "x"}}')
@example(b'{"type": "DELETED", "object": 5}')
def test_any_line(line: bytes) -> None:
    feed(line)


@given(mutations(POD_EVENT, json_values))
def test_mutated_event(mutation: Any) -> None:
    feed(json.dumps(mutation.doc).encode())
