"""Pod specs for the kubelet emulator, read from ordinary Pod manifests."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.errors import VcudaError

CORE_RESOURCE = "nvidia.com/vcuda-core"
MEMORY_RESOURCE = "nvidia.com/vcuda-memory"


class ManifestError(VcudaError):
    """A Pod manifest the emulator cannot use."""


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    cores: int  # nvidia.com/vcuda-core
    memory_mib: int | None = None  # nvidia.com/vcuda-memory
    init: bool = False


@dataclass(frozen=True)
class PodSpec:
    name: str
    namespace: str = "default"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    containers: tuple[ContainerRequest, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_from_manifest(manifest: Mapping[str, Any]) -> PodSpec:
    if manifest.get("kind") != "Pod":
        raise ManifestError(f"expected kind Pod, got {manifest.get('kind')!r}")
    meta = manifest.get("metadata") or {}
    spec = manifest.get("spec") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ManifestError("the Pod has no metadata.name")
    containers = [_container(c, init=True) for c in spec.get("initContainers") or []]
    containers += [_container(c, init=False) for c in spec.get("containers") or []]
    return PodSpec(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or uuid.uuid4()),
        containers=tuple(containers),
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
    )


def load_manifests(path: Path) -> list[dict[str, Any]]:
    """Every document of a YAML file (multi-document files too)."""
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as err:
        raise ManifestError(f"cannot read pods from {path}: {err}") from err


def load_pods(path: Path) -> list[PodSpec]:
    """Every Pod in a YAML file (multi-document files too)."""
    return [pod_from_manifest(d) for d in load_manifests(path)]


def _container(raw: Mapping[str, Any], init: bool) -> ContainerRequest:
    name = str(raw.get("name") or "")
    resources = raw.get("resources") or {}
    limits = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    return ContainerRequest(
        name=name,
        cores=_quantity(limits.get(CORE_RESOURCE, 0), name, CORE_RESOURCE),
        memory_mib=_quantity(limits[MEMORY_RESOURCE], name, MEMORY_RESOURCE)
        if MEMORY_RESOURCE in limits
        else None,
        init=init,
    )


def _quantity(value: Any, container: str, resource: str) -> int:
    # Extended resources are integers; kubelet refuses fractional quantities for them.
    try:
        return int(str(value))
    except ValueError as err:
        raise ManifestError(f"container {container!r}: {resource} must be an integer, got {value!r}") from err
