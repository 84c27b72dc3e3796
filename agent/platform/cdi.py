"""Container Device Interface (CDI) spec files: what a container gets for a CDI device ID.

kubelet hands the runtime (containerd, CRI-O) the CDI device IDs a DRA driver answered
(``vendor.com/class=name``); the runtime looks each up in the spec files of its CDI
directories (``/etc/cdi``, ``/var/run/cdi``) and applies that device's ``containerEdits``:
device nodes, mounts, environment. This module writes such files (JSON, ``cdiVersion``
0.6.0; the fields used are those of github.com/cncf-tags/container-device-interface
SPEC.md) and names them as that project's ``GenerateTransientSpecName`` does, one file per
claim, so one claim's file can be removed without touching another's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import PlatformError
from agent.platform.atomicfile import remove, write_atomic

CDI_VERSION = "0.6.0"  # 0.6.0 added annotations; nothing newer is used
# Device names and the class part of a kind: alphanumeric at both ends, "-_." between.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class CdiError(PlatformError):
    """A CDI name that the spec does not allow, or a spec file that cannot be written."""


@dataclass(frozen=True)
class DeviceNode:
    path: str  # in the container
    host_path: str
    permissions: str = "rw"  # cgroup device access: r, w, m


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[str, ...] = ()  # "NAME=value"
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()

    def to_json(self) -> dict[str, Any]:
        edits: dict[str, Any] = {}
        if self.env:
            edits["env"] = list(self.env)
        if self.device_nodes:
            edits["deviceNodes"] = [
                {"path": d.path, "hostPath": d.host_path, "permissions": d.permissions}
                for d in self.device_nodes
            ]
        if self.mounts:
            # What nvidia-ctk writes for driver files: a bind mount, no suid, no device files.
            edits["mounts"] = [
                {
                    "hostPath": m.host_path,
                    "containerPath": m.container_path,
                    "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"],
                }
                for m in self.mounts
            ]
        return edits


@dataclass(frozen=True)
class CdiDevice:
    name: str
    edits: ContainerEdits


def check_kind(kind: str) -> tuple[str, str]:
    """(vendor, class) of ``vendor.com/class``; CdiError when the spec does not allow it."""
    vendor, sep, cls = kind.partition("/")
    labels = vendor.split(".")
    if not sep or len(vendor) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise CdiError(f"CDI kind {kind!r}: expected <DNS subdomain>/<name>, e.g. vcuda.io/gpu")
    if len(cls) > 63 or not _NAME.match(cls):
        raise CdiError(f"CDI kind {kind!r}: the class must be alphanumeric at both ends, -_. between")
    return vendor, cls


def check_device_name(name: str) -> str:
    if not _NAME.match(name):
        raise CdiError(f"CDI device name {name!r}: alphanumeric at both ends, only -_. between")
    return name


def qualified_name(kind: str, name: str) -> str:
    """The CDI device ID a runtime is given: ``vendor.com/class=name``."""
    return f"{kind}={check_device_name(name)}"


def transient_spec_path(directory: Path, kind: str, transient_id: str) -> Path:
    """``<dir>/<vendor>-<class>_<id>.json``, the name CDI's GenerateTransientSpecName gives a
    spec that lives only as long as one allocation."""
    vendor, cls = check_kind(kind)
    if not _NAME.match(transient_id):
        raise CdiError(f"CDI transient spec ID {transient_id!r}: alphanumeric at both ends, -_. between")
    return directory / f"{vendor}-{cls}_{transient_id}.json"


def spec_json(
    kind: str, devices: Sequence[CdiDevice], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A spec's JSON object; CdiError for a bad kind, a bad or repeated device name, or no
    device (a spec must list at least one)."""
    check_kind(kind)
    if not devices:
        raise CdiError(f"a CDI spec of kind {kind} needs at least one device")
    names = [check_device_name(d.name) for d in devices]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CdiError(f"CDI device names repeated in one spec: {', '.join(repeated)}")
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": kind}
    if annotations:
        spec["annotations"] = dict(annotations)
    spec["devices"] = [{"name": d.name, "containerEdits": d.edits.to_json()} for d in devices]
    return spec


def write_spec(path: Path, spec: Mapping[str, Any]) -> None:
    """Atomically (a runtime reading the directory never sees half a spec); CdiError if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(spec, indent=2, sort_keys=False) + "\n").encode())
    except (OSError, PlatformError) as err:
        raise CdiError(f"cannot write the CDI spec {path}: {err}") from err


def remove_spec(path: Path) -> bool:
    """Remove a spec file; False if it was already gone."""
    try:
        return remove(path)
    except PlatformError as err:
        raise CdiError(str(err)) from err


def env_list(envs: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in sorted(envs.items()))
