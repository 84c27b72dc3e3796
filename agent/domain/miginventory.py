"""What the node publishes about its GPUs' MIG side: a ``mig`` object per MIG-capable GPU in
the inventory annotation, and GPU feature discovery's MIG labels.

In the annotation (``domain/nodeinventory.py``), a MIG-capable GPU's entry carries::

    "mig": {"mode": "enabled", "pending": "enabled",      # current mode; the one a reset applies
            "devices": [{"gi": 1, "ci": 0, "profile": "3g.40gb", "uuid": "MIG-...",
                         "placement": "0:4",               # start:size on the 8 memory slices
                         "memoryMiB": 40448, "healthy": true}]}

A GPU without MIG has no ``mig`` key. The labels follow GPU feature discovery:
``nvidia.com/mig.capable`` (``true`` when any GPU can do MIG), ``nvidia.com/mig.strategy``
(the node config's MIG strategy; without one, ``mixed`` while any GPU is in MIG mode: its
devices are counted per profile, ``none`` otherwise) and ``nvidia.com/mig-<profile>.count``
(MIG devices of that profile on the node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.platform.gpu.migprofiles import GpuInstanceProfile, MigProduct, Placement, remaining_capacity
from agent.platform.gpu.migstate import MigInfo

MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
_COUNT_LABEL = re.compile(r"^nvidia\.com/mig-[A-Za-z0-9.+_-]+\.count$")
_PLACEMENT = re.compile(r"^([0-9]{1,2}):([0-9]{1,2})$")


@dataclass(frozen=True)
class MigDeviceEntry:
    gi: int
    ci: int
    profile: str
    uuid: str
    placement: str  # "start:size"
    memory_mib: int
    healthy: bool = True


@dataclass(frozen=True)
class MigEntry:
    """A MIG-capable GPU's MIG side as the annotation describes it."""

    enabled: bool
    pending: bool
    devices: tuple[MigDeviceEntry, ...] = ()
    on_demand: bool = False  # serves hardware-isolated shares (mig.onDemand, in MIG mode)
    room: Mapping[str, int] = field(default_factory=dict)  # on demand: profile -> how many more fit


def mig_entry(info: MigInfo, unhealthy_gis: Iterable[int] = (), gpu_healthy: bool = True) -> MigEntry | None:
    """The annotation's view of ``info``; None for a GPU without MIG. A device is unhealthy
    with its GPU or its GPU instance."""
    if not info.capable:
        return None
    bad = set(unhealthy_gis)
    devices = tuple(
        MigDeviceEntry(
            gi=d.gi,
            ci=d.ci,
            profile=d.profile,
            uuid=d.uuid,
            placement=f"{d.placement_start}:{d.placement_size}",
            memory_mib=d.memory_mib,
            healthy=gpu_healthy and d.gi not in bad,
        )
        for d in info.devices
    )
    return MigEntry(info.current, info.pending, devices)


def encode_mig(entry: MigEntry) -> dict[str, Any]:
    body: dict[str, Any] = {
        "mode": _mode(entry.enabled),
        "pending": _mode(entry.pending),
        "devices": [
            {
                "gi": d.gi,
                "ci": d.ci,
                "profile": d.profile,
                "uuid": d.uuid,
                "placement": d.placement,
                "memoryMiB": d.memory_mib,
                "healthy": d.healthy,
            }
            for d in entry.devices
        ],
    }
    if entry.on_demand:
        body["onDemand"] = True
        body["room"] = dict(sorted(entry.room.items()))
    return body


def decode_mig(raw: object) -> MigEntry:
    """Parse a GPU entry's ``mig`` object; ValueError saying what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("must be an object")
    devices = raw.get("devices")
    if not isinstance(devices, list):
        raise ValueError("devices must be a list")
    on_demand = raw.get("onDemand", False)
    if not isinstance(on_demand, bool):
        raise ValueError("onDemand must be true or false")
    room = raw.get("room", {})
    if not isinstance(room, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in room.items()
    ):
        raise ValueError("room must be an object of MIG profile -> count")
    return MigEntry(
        enabled=_parse_mode(raw.get("mode"), "mode"),
        pending=_parse_mode(raw.get("pending"), "pending"),
        devices=tuple(_decode_device(d, i) for i, d in enumerate(devices)),
        on_demand=on_demand,
        room=dict(room),
    )


def _is_count(key: object, value: object) -> bool:
    return isinstance(key, str) and isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _decode_device(raw: object, i: int) -> MigDeviceEntry:
    where = f"devices[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object")
    ints = {k: raw.get(k) for k in ("gi", "ci", "memoryMiB")}
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}.{key} must be a non-negative integer")
    texts = {k: raw.get(k) for k in ("profile", "uuid", "placement")}
    for key, value in texts.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}.{key} must be a non-empty string")
    if not _PLACEMENT.match(str(texts["placement"])):
        raise ValueError(f"{where}.placement must be start:size, got {texts['placement']!r}")
    healthy = raw.get("healthy")
    if not isinstance(healthy, bool):
        raise ValueError(f"{where}.healthy must be true or false")
    return MigDeviceEntry(
        int(ints["gi"] or 0),
        int(ints["ci"] or 0),
        str(texts["profile"]),
        str(texts["uuid"]),
        str(texts["placement"]),
        int(ints["memoryMiB"] or 0),
        healthy,
    )


def _mode(enabled: bool) -> str:
    return "enabled" if enabled else "disabled"


def _parse_mode(value: object, key: str) -> bool:
    if value not in ("enabled", "disabled"):
        raise ValueError(f"{key} must be enabled or disabled, got {value!r}")
    return value == "enabled"


def count_label(profile: str) -> str:
    return f"nvidia.com/mig-{profile}.count"


def is_count_label(key: str) -> bool:
    return bool(_COUNT_LABEL.match(key))


def mig_labels(infos: Mapping[int, MigInfo], strategy: str | None = None) -> dict[str, str]:
    """GPU feature discovery's MIG labels for the node's GPUs (see the module docstring);
    ``strategy``: the node config's MIG strategy, which the label then names."""
    capable = any(i.capable for i in infos.values())
    enabled = [i for i in infos.values() if i.capable and i.current]
    labels = {
        MIG_CAPABLE_LABEL: "true" if capable else "false",
        MIG_STRATEGY_LABEL: strategy or ("mixed" if enabled else "none"),
    }
    counts: dict[str, int] = {}
    for info in enabled:
        for device in info.devices:
            counts[device.profile] = counts.get(device.profile, 0) + 1
    labels.update({count_label(p): str(n) for p, n in sorted(counts.items())})
    return labels


def stale_count_labels(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, None]:
    """``nvidia.com/mig-<profile>.count`` labels on the node that are no longer desired."""
    return {key: None for key in current if is_count_label(key) and key not in desired}


# Isolated shares on demand ----------------------------------------------------------------------
# A GPU in MIG mode that still offers vcuda-core serves hardware-isolated shares on demand: its
# entry says so (``"onDemand": true``) and how many more GPU instances of each plain profile
# still fit beside its instances (``"room": {"1g.10gb": 4, ...}``), which the extender reads.


def gi_profile_name(device_profile: str) -> str:
    """The GPU instance profile of a MIG device's name: ``1c.3g.40gb`` -> ``3g.40gb``."""
    head, _, rest = device_profile.partition(".")
    return rest if head.endswith("c") and head[:-1].isdigit() and rest else device_profile


def entry_instances(gpu: MigProduct, entry: MigEntry) -> list[tuple[GpuInstanceProfile, Placement]]:
    """The entry's GPU instances (one per GI) as migfit takes them; names the product lacks
    are left out."""
    seen: dict[int, tuple[GpuInstanceProfile, Placement]] = {}
    for d in entry.devices:
        profile = gpu.by_name(gi_profile_name(d.profile))
        match = _PLACEMENT.match(d.placement)
        if profile is not None and match is not None and d.gi not in seen:
            seen[d.gi] = (profile, Placement(int(match.group(1)), int(match.group(2))))
    return list(seen.values())


def on_demand_entry(entry: MigEntry, gpu: MigProduct | None) -> MigEntry:
    """``entry`` marked on demand, with the room left per plain profile."""
    if gpu is None:
        return replace(entry, on_demand=True)
    existing = entry_instances(gpu, entry)
    room = {p.name: remaining_capacity(p, existing) for p in gpu.profiles if not p.media}
    return replace(entry, on_demand=True, room=room)
