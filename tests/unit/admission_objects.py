"""AdmissionRequest-style objects for the admission policy tests: a pod and a Node as the API
server hands them to admission (their unstructured form), and writes to them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

from agent.domain.annotations import CORE_LIMIT, POLICY
from agent.domain.nodeinventory import CAPACITY_RESOURCE
from tests.unit.admission_policy import Doc

NODE = "gpu-node-1"
OTHER = "gpu-node-2"


def pod(node: str | None = NODE) -> Doc:
    """A pod as the API server hands it to admission (the unstructured form of the object)."""
    spec: Doc = {
        "containers": [
            {
                "name": "cuda",
                "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
                "resources": {"limits": {"nvidia.com/vcuda-core": "50", "nvidia.com/vcuda-memory": "2048"}},
            }
        ],
        "initContainers": [
            {
                "name": "warm",
                "image": "busybox:1.36",
                "resources": {"limits": {"nvidia.com/vcuda-core": "20"}},
            }
        ],
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "serviceAccountName": "default",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}],
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0",
            "namespace": "ml",
            "uid": "9f0c1b2a-3d4e-4f5a-8b6c-7d8e9f0a1b2c",
            "resourceVersion": "5150",
            "creationTimestamp": "2025-01-02T03:04:05Z",
            "labels": {"app": "train"},
            "annotations": {CORE_LIMIT: "60", POLICY: "burst-share"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": "train",
                    "uid": "1c2d",
                    "controller": True,
                }
            ],
            "managedFields": [
                {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1"}
            ],
        },
        "spec": spec,
        "status": {"phase": "Pending", "qosClass": "BestEffort"},
    }


def node(name: str = NODE) -> Doc:
    allocatable = {"cpu": "63", "memory": "526183316Ki", "pods": "110", "nvidia.com/vcuda-core": "400"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": "6a1f9c2d-7e33-4a88-b2c4-6f9d0e1a3b57",
            "resourceVersion": "1021",
            "creationTimestamp": "2025-01-02T03:04:05Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "nvidia-device-enable": "enable",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1"}],
        },
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {
            "capacity": {**allocatable, "cpu": "64", "memory": "528280468Ki"},
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.11"},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": "v1.32.4", "containerRuntimeVersion": "containerd://1.7.24"},
            "images": [{"names": ["nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"], "sizeBytes": 105718424}],
        },
    }


def patched(obj: Doc, change: Callable[[Doc], object]) -> Doc:
    """``obj`` after a write, as validating admission sees it: the change, plus what the API server
    itself updates on every write (resourceVersion, the writer's managedFields entry)."""
    new = copy.deepcopy(obj)
    change(new)
    meta = new["metadata"]
    meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
    meta["managedFields"] = [*meta["managedFields"], {"manager": "vcuda-agent", "operation": "Update"}]
    return new


def merge(field: str, values: Mapping[str, str | None]) -> Callable[[Doc], object]:
    """A merge patch of metadata.<field> (None deletes a key), as PodWriter/NodeClient send."""

    def apply(obj: Doc) -> None:
        current = obj["metadata"].setdefault(field, {})
        for key, value in values.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        if not current:
            del obj["metadata"][field]  # the API server omits an empty map

    return apply


def vcuda_memory(mib: str, *fields: str) -> Callable[[Doc], object]:
    def apply(obj: Doc) -> None:
        for field in fields or ("capacity", "allocatable"):
            obj["status"][field][CAPACITY_RESOURCE] = mib

    return apply
