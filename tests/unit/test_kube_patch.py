"""The fake API server's patch formats: JSON merge patch (RFC 7386) and JSON patch (RFC 6902)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.emulators.apiserver_patch import PatchError, json_patch, merge_patch


@pytest.mark.parametrize(
    ("target", "patch", "result"),
    [  # the examples of RFC 7386, appendix A
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"a": "b"}, ["c"], ["c"]),
        ({"a": "foo"}, None, None),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_rfc7386_examples(target: Any, patch: Any, result: Any) -> None:
    assert merge_patch(target, patch) == result


def test_merge_patch_does_not_modify_its_inputs() -> None:
    target, patch = {"a": {"b": 1}}, {"a": {"c": {"d": 2}}}
    out = merge_patch(target, patch)
    out["a"]["c"]["d"] = 3
    assert target == {"a": {"b": 1}} and patch == {"a": {"c": {"d": 2}}}


def test_json_patch_operations() -> None:
    doc = {"metadata": {"annotations": {"a/b": "1", "t~x": "2"}}, "list": [1, 2]}
    ops = [
        {"op": "add", "path": "/metadata/annotations/new~1key", "value": "3"},
        {"op": "replace", "path": "/metadata/annotations/a~1b", "value": "9"},
        {"op": "remove", "path": "/metadata/annotations/t~0x"},
        {"op": "add", "path": "/list/-", "value": 3},
        {"op": "add", "path": "/list/0", "value": 0},
        {"op": "copy", "from": "/list/3", "path": "/copied"},
        {"op": "move", "from": "/copied", "path": "/moved"},
        {"op": "test", "path": "/moved", "value": 3},
    ]
    assert json_patch(doc, ops) == {
        "metadata": {"annotations": {"a/b": "9", "new/key": "3"}},
        "list": [0, 1, 2, 3],
        "moved": 3,
    }
    assert doc["list"] == [1, 2]  # the input is not modified


@pytest.mark.parametrize(
    ("ops", "code"),
    [
        ([{"op": "test", "path": "/a", "value": 2}], 422),
        ([{"op": "replace", "path": "/missing", "value": 1}], 422),
        ([{"op": "remove", "path": "/missing"}], 422),
        ([{"op": "add", "path": "/missing/child", "value": 1}], 422),
        ([{"op": "add", "path": "/list/9", "value": 1}], 422),
        ([{"op": "add", "path": "/a/x", "value": 1}], 422),
        ([{"op": "remove", "path": ""}], 422),
        ([{"op": "frobnicate", "path": "/a"}], 400),
        ([{"op": "add", "path": "no-slash", "value": 1}], 400),
        ([{"op": "move", "path": "/b"}], 400),
        ([{"op": "add"}], 400),
        ({"op": "add", "path": "/b", "value": 1}, 400),
    ],
)
def test_json_patch_errors(ops: Any, code: int) -> None:
    with pytest.raises(PatchError) as caught:
        json_patch({"a": 1, "list": []}, ops)
    assert caught.value.code == code
