"""The node config (ConfigMap ``gpu-manager-config``, key ``config.json``).

    {"nodeConfig": [{"name": "gpu-node-1", "deviceMemoryScaling": 0.9,
                     "containerRuntimeEndpoint": "/run/containerd/containerd.sock",
                     "cgroupDriver": "systemd", "sharingMode": "auto",
                     "allowedPolicies": ["fixed-share", "burst-share"], "maxLimitRatio": 1.0,
                     "mpsAdvisoryLimits": false,
                     "mig": {"strategy": "mixed", "geometry": {"0": ["3g.40gb", "2g.20gb"]}}}]}

``mig``: the MIG strategy and geometry (``domain/migconfig.py``). Nodes that are not
listed get the defaults. Parsing reports every invalid field
with the node it belongs to, not just the first.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.domain.migconfig import MigConfig, parse_mig
from agent.errors import ConfigError

CGROUP_DRIVERS = ("systemd", "cgroupfs")
SHARING_MODES = ("freezer", "mps", "auto")
POLICIES = ("fixed-share", "burst-share", "best-effort")
SAFE_POLICIES = ("fixed-share", "burst-share")  # what pods may pick unless the admin says more
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NODE_FIELDS = (
    "name",
    "deviceMemoryScaling",
    "containerRuntimeEndpoint",
    "cgroupDriver",
    "sharingMode",
    "allowedPolicies",
    "maxLimitRatio",
    "mpsAdvisoryLimits",
    "mig",
)
_TOP_FIELDS = ("nodeConfig",)


@dataclass(frozen=True)
class NodeConfig:
    """Per-node settings; ``None`` means auto-detect."""

    name: str
    device_memory_scaling: float = 1.0  # vcuda-memory advertised = GPU memory x this, 0 < x <= 1
    container_runtime_endpoint: str | None = None  # e.g. unix:///run/containerd/containerd.sock
    cgroup_driver: str | None = None  # "systemd" or "cgroupfs"
    sharing_mode: str | None = None  # "freezer", "mps" or "auto"; None: the agent's --sharing-mode
    allowed_policies: tuple[str, ...] = SAFE_POLICIES  # policies a pod annotation may pick
    max_limit_ratio: float = 1.0  # a fixed-share cap is at most request x this (vcuda-core-limit)
    # Use MPS limits a tenant can lift (every driver so far: docs/security.md); None: the
    # agent's --mps-advisory-limits (default no: the freezer holds those shares instead).
    mps_advisory_limits: bool | None = None
    mig: MigConfig = field(default_factory=MigConfig)  # MIG strategy and geometry


@dataclass(frozen=True)
class ClusterConfig:
    nodes: Mapping[str, NodeConfig] = field(default_factory=dict)

    def for_node(self, name: str) -> NodeConfig:
        return self.nodes.get(name) or NodeConfig(name=name)


def parse_config(text: str, source: str = "config") -> ClusterConfig:
    """Parse and validate; raise ``ConfigError`` listing every problem."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise ConfigError([f"{source}: not valid JSON: {err}"]) from err
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError([f"{source}: the top level must be a JSON object with a nodeConfig list"])
    problems += [
        f"{source}: unknown field {k!r} (known: {', '.join(_TOP_FIELDS)})"
        for k in raw
        if k not in _TOP_FIELDS
    ]
    entries = raw.get("nodeConfig", [])
    if not isinstance(entries, list):
        problems.append(f"{source}: nodeConfig must be a list, got {_kind(entries)}")
        entries = []
    nodes: dict[str, NodeConfig] = {}
    for i, entry in enumerate(entries):
        node = _parse_node(entry, f"{source}: nodeConfig[{i}]", problems)
        if node is None:
            continue
        if node.name in nodes:
            problems.append(f"{source}: nodeConfig[{i}] (node {node.name!r}): node listed twice")
        nodes[node.name] = node
    if problems:
        raise ConfigError(problems)
    return ClusterConfig(nodes)


def load_config(path: Path) -> ClusterConfig:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror or err}"]) from err
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not UTF-8 text: {err}"]) from err
    return parse_config(text, str(path))


def _parse_node(entry: Any, where: str, problems: list[str]) -> NodeConfig | None:
    if not isinstance(entry, dict):
        problems.append(f"{where}: must be an object, got {_kind(entry)}")
        return None
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"{where}: name is required and must be a non-empty string")
        return None
    where = f"{where} (node {name!r})"
    before = len(problems)
    if len(name) > 253 or not _NODE_NAME.fullmatch(name):
        problems.append(f"{where}: name is not a valid Kubernetes node name (lowercase DNS subdomain)")
    problems += [
        f"{where}: unknown field {k!r} (known: {', '.join(_NODE_FIELDS)})"
        for k in entry
        if k not in _NODE_FIELDS
    ]
    scaling = entry.get("deviceMemoryScaling", 1.0)
    valid_number = (
        isinstance(scaling, int | float)
        and not isinstance(scaling, bool)
        and (isinstance(scaling, int) or math.isfinite(scaling))  # isfinite() overflows on 10**400
    )
    if not valid_number or not 0 < scaling <= 1:
        problems.append(f"{where}: deviceMemoryScaling must be a number with 0 < x <= 1, got {scaling!r}")
    endpoint = entry.get("containerRuntimeEndpoint")
    if endpoint is not None and not _valid_endpoint(endpoint):
        problems.append(
            f"{where}: containerRuntimeEndpoint must be an absolute socket path or unix:///path, "
            f"got {endpoint!r}"
        )
    driver = entry.get("cgroupDriver")
    if driver is not None and driver not in CGROUP_DRIVERS:
        problems.append(f"{where}: cgroupDriver must be one of {', '.join(CGROUP_DRIVERS)}, got {driver!r}")
    sharing = entry.get("sharingMode")
    if sharing is not None and sharing not in SHARING_MODES:
        problems.append(f"{where}: sharingMode must be one of {', '.join(SHARING_MODES)}, got {sharing!r}")
    allowed = entry.get("allowedPolicies", list(SAFE_POLICIES))
    if not isinstance(allowed, list) or not allowed or any(p not in POLICIES for p in allowed):
        problems.append(
            f"{where}: allowedPolicies must be a non-empty list of {', '.join(POLICIES)}, got {allowed!r}"
        )
    ratio = entry.get("maxLimitRatio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 1 <= ratio <= 100:
        problems.append(f"{where}: maxLimitRatio must be a number from 1 to 100, got {ratio!r}")
    advisory = entry.get("mpsAdvisoryLimits")
    if advisory is not None and not isinstance(advisory, bool):
        problems.append(f"{where}: mpsAdvisoryLimits must be true or false, got {advisory!r}")
    mig = parse_mig(entry["mig"], where, problems) if "mig" in entry else MigConfig()
    if len(problems) > before:
        return None
    return NodeConfig(
        name, float(scaling), endpoint, driver, sharing, tuple(allowed), float(ratio), advisory, mig
    )


def _valid_endpoint(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    path = value.removeprefix("unix://")
    return path.startswith("/") and len(path) > 1


def _kind(value: Any) -> str:
    return type(value).__name__
