"""Pod objects as the API server returns them, and GPUs, for the allocation unit tests."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.pods import PodInfo, pod_from_json

NODE = "gpu-node-1"


def make_gpus(count: int = 2, memory_mib: int = 81920) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=i,
            uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd",
            model="NVIDIA H100 80GB HBM3",
            memory_mib=memory_mib,
            minor=i,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=0,
        )
        for i in range(count)
    ]


def container(name: str, cores: int | None = None, memory: int | None = None) -> dict[str, Any]:
    limits: dict[str, str] = {}
    if cores is not None:
        limits["nvidia.com/vcuda-core"] = str(cores)
    if memory is not None:
        limits["nvidia.com/vcuda-memory"] = str(memory)
    return {"name": name, "image": "cuda", "resources": {"limits": limits}}


def pod_json(
    name: str,
    *containers: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    annotations: Mapping[str, str] | None = None,
    created: str = "2026-11-22T10:00:00Z",
    phase: str = "Pending",
    node: str = NODE,
    namespace: str = "default",
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{namespace}.{name}")),
            "creationTimestamp": created,
            "resourceVersion": "1",
            "annotations": dict(annotations or {}),
        },
        "spec": {"nodeName": node, "containers": list(containers), "initContainers": list(init)},
        "status": {"phase": phase, "qosClass": "BestEffort"},
    }


def make_pod(name: str, *containers: dict[str, Any], **kwargs: Any) -> PodInfo:
    return pod_from_json(pod_json(name, *containers, **kwargs))
