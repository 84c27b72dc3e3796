"""Objects for the DRA tests: GPUs, the node's slice, the shipped DeviceClass, claims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agent.domain.draslice import build_slice, desired_devices
from agent.platform.gpu.inventory import GpuInfo

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"
H100_MIB = 81559
GPUS = (
    GpuInfo(
        0,
        "GPU-0a1b2c3d-0000-4000-8000-000000000000",
        "NVIDIA H100 80GB HBM3",
        H100_MIB,
        0,
        "00000000:18:00.0",
        0,
    ),
    GpuInfo(
        1,
        "GPU-0a1b2c3d-1111-4000-8000-000000000001",
        "NVIDIA H100 80GB HBM3",
        H100_MIB,
        1,
        "00000000:3B:00.0",
        1,
    ),
)
CLASS = "vcuda-gpu"

Doc = dict[str, Any]


def device_class() -> Doc:
    """The DeviceClass deploy/overlays/dra ships."""
    [doc] = [d for d in yaml.safe_load_all((ROOT / "deploy/overlays/dra/deviceclass.yaml").read_text()) if d]
    assert doc["kind"] == "DeviceClass"
    return dict(doc)


def node_slice(
    node: str = NODE,
    gpus: tuple[GpuInfo, ...] = GPUS,
    healthy: dict[int, bool] | None = None,
    generation: int = 1,
) -> Doc:
    return build_slice(node, desired_devices(gpus, healthy or {}, 1.0, "550.54.15"), generation)


def claim(
    name: str,
    cores: str | None = None,
    memory: str | None = None,
    *,
    device_class: str = CLASS,
    count: int | None = None,
    selectors: list[str] | None = None,
    config: list[Doc] | None = None,
    namespace: str = "default",
) -> Doc:
    requests = {k: v for k, v in (("cores", cores), ("memory", memory)) if v is not None}
    exactly: Doc = {"deviceClassName": device_class}
    if requests:
        exactly["capacity"] = {"requests": requests}
    if count is not None:
        exactly["allocationMode"], exactly["count"] = "ExactCount", count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    devices: Doc = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": devices},
    }


def share_config(policy: str, limit: int | None = None, requests: list[str] | None = None) -> Doc:
    parameters: Doc = {"apiVersion": "gpu.vcuda.io/v1alpha1", "kind": "ShareConfig", "policy": policy}
    if limit is not None:
        parameters["limit"] = limit
    entry: Doc = {"opaque": {"driver": "gpu.vcuda.io", "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry
