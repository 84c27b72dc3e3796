"""The kube-scheduler extender protocol, v1 (``k8s.io/kube-scheduler/extender/v1``), as JSON.

What kube-scheduler POSTs and reads back (field names are the Go types' JSON tags):

- filter and prioritize get ``ExtenderArgs`` ``{"pod": Pod, "nodes": NodeList,
  "nodenames": [str]}``: ``nodes`` (full Node objects) when the extender is configured with
  ``nodeCacheCapable: false``, ``nodenames`` when it is ``true``.
- filter answers ``ExtenderFilterResult`` ``{"nodes": NodeList, "nodenames": [str],
  "failedNodes": {node: reason}, "failedAndUnresolvableNodes": {node: reason}, "error": str}``;
  the scheduler reads ``nodenames`` in nodeCacheCapable mode and ``nodes`` otherwise, so the
  answer uses the form of the question. ``failedAndUnresolvableNodes`` tells the scheduler
  that preempting pods on those nodes would not help.
- prioritize answers ``HostPriorityList`` ``[{"host": str, "score": int}]``, scores 0..10
  (``MaxExtenderPriority``), multiplied by the extender's ``weight``.
- bind gets ``ExtenderBindingArgs`` ``{"podName", "podNamespace", "podUID", "node"}`` and
  answers ``ExtenderBindingResult`` ``{"error": str}`` (empty: bound).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import VcudaError
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE

MAX_PRIORITY = 10  # extenderv1.MaxExtenderPriority
_GPU_MARKERS = (CORE_RESOURCE.encode(), MEMORY_RESOURCE.encode())


class WireError(VcudaError):
    """A request body that is not the extender protocol; the message says what is wrong."""


@dataclass(frozen=True)
class ExtenderArgs:
    """A filter or prioritize request."""

    pod: Mapping[str, Any]  # the Pod as the API server returns it
    node_names: tuple[str, ...]  # candidate nodes, in the scheduler's order
    nodes: tuple[Mapping[str, Any], ...] | None  # the Node objects; None in nodeCacheCapable mode


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def may_want_gpu(body: bytes) -> bool:
    """False only when the request cannot be for a GPU pod: neither resource name occurs in
    the body at all. A cheap test that lets other pods skip the pod parse entirely."""
    return any(marker in body for marker in _GPU_MARKERS)


def _load_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise WireError(f"the {what} body is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise WireError(f"the {what} body must be a JSON object, got {type(data).__name__}")
    return data


def parse_args(body: bytes) -> ExtenderArgs:
    """Decode ``ExtenderArgs``; WireError when it is not one."""
    data = _load_object(body, "ExtenderArgs")
    pod = data.get("pod")
    if not isinstance(pod, dict):
        raise WireError("ExtenderArgs has no pod object")
    raw_list = data.get("nodes")
    if raw_list is not None:
        items = raw_list.get("items") if isinstance(raw_list, dict) else None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise WireError("ExtenderArgs.nodes must be a NodeList with an items list of Node objects")
        names = tuple(_node_name(i) for i in items)
        if not all(names):
            raise WireError("a Node in ExtenderArgs.nodes has no metadata.name")
        return ExtenderArgs(pod, names, tuple(items))
    raw_names = data.get("nodenames")
    if not isinstance(raw_names, list) or not all(isinstance(n, str) for n in raw_names):
        raise WireError("ExtenderArgs needs nodes (a NodeList) or nodenames (a list of node names)")
    return ExtenderArgs(pod, tuple(raw_names), None)


def _node_name(node: dict[str, Any]) -> str:
    meta = node.get("metadata")
    return str(meta.get("name") or "") if isinstance(meta, dict) else ""  # not an object: no name


def parse_binding(body: bytes) -> BindingArgs:
    """Decode ``ExtenderBindingArgs``; WireError when a field is missing."""
    data = _load_object(body, "ExtenderBindingArgs")
    fields = {}
    for key in ("podName", "podNamespace", "podUID", "node"):
        value = data.get(key)
        if not isinstance(value, str) or not value:
            raise WireError(f"ExtenderBindingArgs.{key} is missing or not a string")
        fields[key] = value
    return BindingArgs(fields["podName"], fields["podNamespace"], fields["podUID"], fields["node"])


def filter_result(
    args: ExtenderArgs,
    passed: Sequence[str],
    failed: Mapping[str, str] | None = None,
    unresolvable: Mapping[str, str] | None = None,
    error: str = "",
) -> dict[str, Any]:
    """``ExtenderFilterResult`` in the form of the request: Node objects or node names."""
    result: dict[str, Any] = {}
    if args.nodes is None:
        result["nodenames"] = list(passed)
    else:
        keep = set(passed)
        items = [n for name, n in zip(args.node_names, args.nodes, strict=True) if name in keep]
        result["nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
    result["failedNodes"] = dict(failed or {})
    result["failedAndUnresolvableNodes"] = dict(unresolvable or {})
    if error:
        result["error"] = error
    return result


def pass_through(args: ExtenderArgs) -> dict[str, Any]:
    """Every candidate node, untouched (a pod that asks for no vcuda resource)."""
    return filter_result(args, args.node_names)


def unresolvable(args: ExtenderArgs, reason: str) -> dict[str, Any]:
    """Every node failed for a reason no preemption can fix (an invalid request)."""
    return filter_result(args, (), unresolvable={name: reason for name in args.node_names})


def priority_list(node_names: Sequence[str], scores: Mapping[str, int]) -> list[dict[str, Any]]:
    """``HostPriorityList`` in the request's node order; scores clamped to 0..10."""
    return [
        {"host": name, "score": max(0, min(MAX_PRIORITY, int(scores.get(name, 0))))} for name in node_names
    ]


def binding_result(error: str = "") -> dict[str, Any]:
    return {"error": error} if error else {}
