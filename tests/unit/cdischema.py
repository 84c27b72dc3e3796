"""A checker for the CDI spec fields the DRA plugin writes (cncf-tags/container-device-interface
SPEC.md, cdiVersion 0.6.0): required fields, types, name rules, and no field CDI does not have."""

from __future__ import annotations

import re
from typing import Any

_SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_KEYS = {"name", "annotations", "containerEdits"}
_EDIT_KEYS = {"env", "deviceNodes", "mounts", "hooks", "additionalGIDs", "intelRdt"}
_NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_MOUNT_KEYS = {"hostPath", "containerPath", "type", "options"}
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_KIND = re.compile(
    r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"
)
_SEMVER = re.compile(r"^\d+\.\d+\.\d+$")


def cdi_problems(spec: Any) -> list[str]:
    """Every way ``spec`` breaks the CDI spec; [] when it is valid."""
    problems: list[str] = []
    if not isinstance(spec, dict):
        return ["the spec is not an object"]
    problems += [f"unknown field {k}" for k in set(spec) - _SPEC_KEYS]
    if not _SEMVER.match(str(spec.get("cdiVersion", ""))):
        problems.append(f"cdiVersion {spec.get('cdiVersion')!r} is not a semantic version")
    if not _KIND.match(str(spec.get("kind", ""))):
        problems.append(f"kind {spec.get('kind')!r} is not <vendor domain>/<class>")
    _check_string_map(spec.get("annotations"), "annotations", problems)
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices must be a non-empty list")
        devices = []
    names = []
    for i, device in enumerate(devices):
        where = f"devices[{i}]"
        if not isinstance(device, dict):
            problems.append(f"{where} is not an object")
            continue
        problems += [f"{where}: unknown field {k}" for k in set(device) - _DEVICE_KEYS]
        name = device.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(f"{where}.name {name!r} is not a CDI device name")
        names.append(name)
        _check_string_map(device.get("annotations"), f"{where}.annotations", problems)
        _check_edits(device.get("containerEdits", {}), f"{where}.containerEdits", problems)
    if len(set(map(str, names))) != len(names):
        problems.append(f"device names repeat: {names}")
    if "containerEdits" in spec:
        _check_edits(spec["containerEdits"], "containerEdits", problems)
    return problems


def _check_string_map(value: Any, where: str, problems: list[str]) -> None:
    if value is not None and not (
        isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        problems.append(f"{where} is not a map of strings")


def _check_edits(edits: Any, where: str, problems: list[str]) -> None:
    if not isinstance(edits, dict):
        problems.append(f"{where} is not an object")
        return
    problems += [f"{where}: unknown field {k}" for k in set(edits) - _EDIT_KEYS]
    for i, env in enumerate(edits.get("env", [])):
        if not isinstance(env, str) or "=" not in env or env.startswith("="):
            problems.append(f"{where}.env[{i}] {env!r} is not NAME=value")
    for i, node in enumerate(edits.get("deviceNodes", [])):
        at = f"{where}.deviceNodes[{i}]"
        if not isinstance(node, dict):
            problems.append(f"{at} is not an object")
            continue
        problems += [f"{at}: unknown field {k}" for k in set(node) - _NODE_KEYS]
        if not str(node.get("path", "")).startswith("/"):
            problems.append(f"{at}.path {node.get('path')!r} is not absolute")
        if "hostPath" in node and not str(node["hostPath"]).startswith("/"):
            problems.append(f"{at}.hostPath {node['hostPath']!r} is not absolute")
        if not set(str(node.get("permissions", ""))) <= set("rwm"):
            problems.append(f"{at}.permissions {node.get('permissions')!r} is not a subset of rwm")
    for i, mount in enumerate(edits.get("mounts", [])):
        at = f"{where}.mounts[{i}]"
        if not isinstance(mount, dict):
            problems.append(f"{at} is not an object")
            continue
        problems += [f"{at}: unknown field {k}" for k in set(mount) - _MOUNT_KEYS]
        for key in ("hostPath", "containerPath"):
            if not str(mount.get(key, "")).startswith("/"):
                problems.append(f"{at}.{key} {mount.get(key)!r} is missing or not absolute")
        options = mount.get("options", [])
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            problems.append(f"{at}.options is not a list of strings")
