"""What the fake API server fills in on objects (defaulting) and the objects its test
hooks build: pod QoS class, pod status for a phase, nodes, kubelet's zeroing of
extended resources."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

_COMPUTE = ("cpu", "memory")
DEFAULT_NODE_CAPACITY = {"cpu": "16", "memory": "65536Mi", "pods": "110", "ephemeral-storage": "100Gi"}


def now_rfc3339() -> str:
    """The API's timestamp format: RFC 3339, UTC, whole seconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_metadata(obj: dict[str, Any], namespace: str | None) -> dict[str, Any]:
    """Server-set metadata of a new object (uid, creationTimestamp, namespace, generated name)."""
    meta = obj.setdefault("metadata", {})
    if namespace is not None:
        meta["namespace"] = namespace
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now_rfc3339()
    return obj


def default_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """status.phase Pending and status.qosClass, as the API server sets them on create."""
    status = pod.setdefault("status", {})
    status.setdefault("phase", "Pending")
    status["qosClass"] = qos_class(pod)
    return pod


def qos_class(pod: Mapping[str, Any]) -> str:
    """Guaranteed / Burstable / BestEffort from cpu and memory requests and limits (all containers)."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    guaranteed, any_set = True, False
    for container in containers:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}  # requests default to limits
        for name in _COMPUTE:
            if name in limits or name in requests:
                any_set = True
            if name not in limits or str(requests.get(name)) != str(limits[name]):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def pod_status(
    pod: Mapping[str, Any], phase: str, container_ids: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A pod status for ``phase`` with one container status per container, as kubelet reports it.

    ``container_ids`` maps container names to IDs; an ID without a scheme gets ``containerd://``.
    """
    ids = container_ids or {}
    spec = pod.get("spec") or {}
    status = copy.deepcopy(dict(pod.get("status") or {}))
    status["phase"] = phase

    def statuses(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for container in containers:
            name = str(container.get("name") or "")
            entry: dict[str, Any] = {
                "name": name,
                "image": str(container.get("image") or ""),
                "imageID": "",
                "ready": phase == "Running",
                "restartCount": 0,
                "state": _container_state(phase),
            }
            if name in ids:
                cid = ids[name]
                entry["containerID"] = cid if "://" in cid else f"containerd://{cid}"
            out.append(entry)
        return out

    status["initContainerStatuses"] = statuses(list(spec.get("initContainers") or []))
    status["containerStatuses"] = statuses(list(spec.get("containers") or []))
    if phase != "Pending":
        status.setdefault("startTime", now_rfc3339())
    return status


def _container_state(phase: str) -> dict[str, Any]:
    if phase == "Running":
        return {"running": {"startedAt": now_rfc3339()}}
    if phase in ("Succeeded", "Failed"):
        code = 0 if phase == "Succeeded" else 1
        reason = "Completed" if phase == "Succeeded" else "Error"
        return {"terminated": {"exitCode": code, "reason": reason, "finishedAt": now_rfc3339()}}
    return {"waiting": {"reason": "ContainerCreating"}}


def node_manifest(
    name: str,
    labels: Mapping[str, str] | None = None,
    capacity: Mapping[str, str] | None = None,
    allocatable: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as kubelet registers it: labels, capacity, allocatable (= capacity unless given), Ready."""
    cap = dict(DEFAULT_NODE_CAPACITY if capacity is None else capacity)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            "annotations": dict(annotations or {}),
        },
        "spec": {},
        "status": {
            "capacity": cap,
            "allocatable": dict(cap if allocatable is None else allocatable),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"boot.{name}")),
                "containerRuntimeVersion": "containerd://2.1.0",
                "kernelVersion": "6.12.0",
                "kubeProxyVersion": "",
                "kubeletVersion": "v1.34.0",
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                "operatingSystem": "linux",
                "osImage": "Debian GNU/Linux 12 (bookworm)",
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"system.{name}")),
            },
            "addresses": [{"type": "Hostname", "address": name}],
        },
    }


def is_extended_resource(name: str) -> bool:
    """Kubernetes' rule: a domain-prefixed name outside kubernetes.io (and not a quota name)."""
    return "/" in name and not name.startswith(("kubernetes.io/", "requests."))


def zero_extended_resources(node: Mapping[str, Any]) -> dict[str, Any]:
    """What kubelet does to a re-created node without a device-manager checkpoint: every
    extended resource in capacity and allocatable becomes "0" (kubelet's
    zeroOutExtendedResourceCapacity); the device plugin or publisher must re-assert it."""
    status = copy.deepcopy(dict(node.get("status") or {}))
    for field in ("capacity", "allocatable"):
        values = status.get(field) or {}
        status[field] = {k: ("0" if is_extended_resource(k) else v) for k, v in values.items()}
    return status
