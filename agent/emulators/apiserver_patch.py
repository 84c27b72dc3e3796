"""The patch formats of the fake API server: JSON merge patch (RFC 7386) and JSON patch
(RFC 6902). Strategic merge patch is treated as a merge patch (maps merge, lists are
replaced), which is what it does for the maps the agent patches (labels, annotations,
status.capacity); its list-merge keys and ``$patch`` directives are not modelled."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class PatchError(ValueError):
    """A patch that cannot be applied; ``code`` is the HTTP status the API server answers."""

    def __init__(self, message: str, code: int = 422) -> None:
        self.code = code
        super().__init__(message)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` deletes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 add / remove / replace / test / move / copy; ``~1`` is "/" and ``~0`` is "~"."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", code=400)
    result = copy.deepcopy(doc)
    for number, op in enumerate(operations):
        if not isinstance(op, Mapping) or not isinstance(op.get("path"), str):
            raise PatchError(f"JSON patch operation {number} has no path", code=400)
        result = _apply(result, op)
    return result


def _apply(doc: Any, op: Mapping[str, Any]) -> Any:
    kind, path = op.get("op"), _pointer(op["path"])
    if kind == "test":
        if _get(doc, path) != op.get("value"):
            raise PatchError(f"test operation failed at {op['path']}")
        return doc
    if kind == "remove":
        return _remove(doc, path)
    if kind == "add":
        return _add(doc, path, copy.deepcopy(op.get("value")))
    if kind == "replace":
        _get(doc, path)  # replace needs an existing target
        return _add(_remove(doc, path), path, copy.deepcopy(op.get("value")))
    if kind in ("move", "copy"):
        if not isinstance(op.get("from"), str):
            raise PatchError(f"{kind} operation without 'from'", code=400)
        source = _pointer(op["from"])
        value = copy.deepcopy(_get(doc, source))
        if kind == "move":
            doc = _remove(doc, source)
        return _add(doc, path, value)
    raise PatchError(f"unknown JSON patch operation {kind!r}", code=400)


def _pointer(text: str) -> list[str]:
    if text == "":
        return []
    if not text.startswith("/"):
        raise PatchError(f"JSON pointer {text!r} does not start with '/'", code=400)
    return [part.replace("~1", "/").replace("~0", "~") for part in text[1:].split("/")]


def _get(doc: Any, path: list[str]) -> Any:
    node = doc
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(f"path /{'/'.join(path)} does not exist")
    return node


def _add(doc: Any, path: list[str], value: Any) -> Any:
    if not path:
        return value
    parent, last = _get(doc, path[:-1]), path[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchError(f"index {last!r} out of range at /{'/'.join(path)}")
    else:
        raise PatchError(f"cannot add below a scalar at /{'/'.join(path)}")
    return doc


def _remove(doc: Any, path: list[str]) -> Any:
    if not path:
        raise PatchError("cannot remove the whole document")
    _get(doc, path)
    parent, last = _get(doc, path[:-1]), path[-1]
    if isinstance(parent, dict):
        del parent[last]
    else:
        del parent[int(last)]
    return doc
