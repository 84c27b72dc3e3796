"""What the node publishes about its GPUs: capacity, the inventory annotation, GFD labels.

The annotation ``nvidia.com/vcuda-inventory`` is read by the scheduler extender,
which treats a bad or stale annotation as "node not eligible". Its value is
compact JSON in a versioned format; version 1:

    {"version": 1,                        # readers refuse versions they do not know
     "heartbeat": "2025-01-02T03:04:05Z", # RFC 3339 UTC; re-written at least every heartbeat period
     "node": "gpu-node-1",
     "memoryScaling": 0.9,                # deviceMemoryScaling of the node config
     "gpus": [{"index": 0, "uuid": "GPU-...", "model": "NVIDIA H100 80GB HBM3",
               "memoryMiB": 81559,
               "schedulableMiB": 73403,   # floor(memoryMiB x memoryScaling)
               "cores": 100,              # vcuda-core units of the GPU (0, and schedulableMiB 0,
                                          # for a GPU in MIG mode: it offers no shares)
               "numa": 0,                 # null when the platform does not say
               "healthy": true,
               "links": {"1": "SINGLE_SWITCH", "2": "SYSTEM"},  # TopologyLevel name per peer index
               "nvlinks": {"1": 18},      # NVLink count per peer; peers without NVLink left out
               "mig": {...}}]}            # MIG-capable GPUs only: domain/miginventory.py
                                          # (a GPU in MIG mode with cores > 0 serves isolated
                                          # shares on demand: "onDemand", "room" there)

Within version 1, fields may be added (readers ignore unknown fields); removing or
changing the meaning of one needs version 2. ``nvidia.com/vcuda-memory`` capacity
is the sum of ``schedulableMiB`` over healthy GPUs.

The labels follow NVIDIA GPU feature discovery: ``nvidia.com/gpu.product`` (model,
spaces as '-'), ``nvidia.com/gpu.count``, ``nvidia.com/gpu.memory`` (MiB of one GPU).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from agent.domain.ids import UNITS_PER_GPU
from agent.domain.miginventory import MigEntry, decode_mig, encode_mig, on_demand_entry
from agent.errors import VcudaError
from agent.platform.gpu.inventory import GpuInfo, Link, Topology, TopologyLevel
from agent.platform.gpu.migprofiles import product_for
from agent.platform.kube.pods import MEMORY_RESOURCE

INVENTORY_ANNOTATION = "nvidia.com/vcuda-inventory"
FORMAT_VERSION = 1
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
CAPACITY_RESOURCE = MEMORY_RESOURCE  # published in MiB in node status capacity and allocatable

_LABEL_VALUE_MAX = 63
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9._-]")
_T = TypeVar("_T")
_PEER = re.compile(r"[0-9]{1,9}")  # a GPU index in ASCII digits ("²".isdigit() is true, int() refuses it)
_JSON_KINDS: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


class InventoryFormatError(VcudaError):
    """An inventory annotation that cannot be read: malformed, or a version this reader lacks."""


@dataclass(frozen=True)
class GpuEntry:
    """One GPU as the annotation describes it."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    schedulable_mib: int
    numa: int | None
    healthy: bool
    links: Mapping[int, Link] = field(default_factory=dict)  # peer index -> link
    cores: int = UNITS_PER_GPU
    mig: MigEntry | None = None  # None: the GPU has no MIG


@dataclass(frozen=True)
class NodeInventory:
    """The decoded annotation; ``heartbeat`` is wall-clock seconds (Unix time)."""

    node: str
    heartbeat: float
    memory_scaling: float
    gpus: tuple[GpuEntry, ...]
    version: int = FORMAT_VERSION

    @property
    def capacity_mib(self) -> int:
        """``nvidia.com/vcuda-memory`` the node offers: schedulable MiB of its healthy GPUs."""
        return sum(g.schedulable_mib for g in self.gpus if g.healthy)

    def age_s(self, now: float) -> float:
        return now - self.heartbeat


def schedulable_mib(memory_mib: int, scaling: float) -> int:
    # round() first: 100 x 0.29 is 28.999999999999996 in binary floating point.
    return math.floor(round(memory_mib * scaling, 6))


def memory_capacity_mib(gpus: Sequence[GpuInfo], healthy: Mapping[int, bool], scaling: float) -> int:
    """Σ over healthy GPUs of floor(memory x scaling); a GPU missing from ``healthy`` counts as healthy."""
    return sum(schedulable_mib(g.memory_mib, scaling) for g in gpus if healthy.get(g.index, True))


def build_inventory(
    node: str,
    gpus: Sequence[GpuInfo],
    topology: Topology,
    *,
    healthy: Mapping[int, bool],
    scaling: float,
    heartbeat: float,
    mig: Mapping[int, MigEntry | None] | None = None,
    withheld: Collection[int] = (),
) -> NodeInventory:
    """``mig``: the MIG side of MIG-capable GPUs (by index; absent or None: no MIG).
    ``withheld``: GPUs that offer no shares (in MIG mode): 0 cores and 0 schedulable MiB. A GPU
    in MIG mode that is not withheld serves isolated shares on demand (its ``mig`` says so)."""
    mig = {i: _mark_on_demand(e, gpus, i, withheld) for i, e in (mig or {}).items()}
    entries = tuple(
        GpuEntry(
            index=g.index,
            uuid=g.uuid,
            model=g.model,
            memory_mib=g.memory_mib,
            schedulable_mib=0 if g.index in withheld else schedulable_mib(g.memory_mib, scaling),
            numa=g.numa_node,
            healthy=healthy.get(g.index, True),
            links={p.index: topology.link(g.index, p.index) for p in gpus if p.index != g.index},
            cores=0 if g.index in withheld else UNITS_PER_GPU,
            mig=(mig or {}).get(g.index),
        )
        for g in sorted(gpus, key=lambda g: g.index)
    )
    return NodeInventory(node=node, heartbeat=heartbeat, memory_scaling=scaling, gpus=entries)


def _mark_on_demand(
    entry: MigEntry | None, gpus: Sequence[GpuInfo], index: int, withheld: Collection[int]
) -> MigEntry | None:
    if entry is None or not entry.enabled or index in withheld:
        return entry
    gpu = next((g for g in gpus if g.index == index), None)
    return on_demand_entry(entry, product_for(gpu.model, gpu.memory_mib) if gpu is not None else None)


def encode(inventory: NodeInventory) -> str:
    """The annotation value: compact JSON, keys in a fixed order (equal content, equal text)."""
    body = {
        "version": inventory.version,
        "heartbeat": format_time(inventory.heartbeat),
        "node": inventory.node,
        "memoryScaling": inventory.memory_scaling,
        "gpus": [_encode_gpu(g) for g in inventory.gpus],
    }
    return json.dumps(body, separators=(",", ":"))


def _encode_gpu(gpu: GpuEntry) -> dict[str, Any]:
    body = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memoryMiB": gpu.memory_mib,
        "schedulableMiB": gpu.schedulable_mib,
        "cores": gpu.cores,
        "numa": gpu.numa,
        "healthy": gpu.healthy,
        "links": {str(peer): link.level.name for peer, link in sorted(gpu.links.items())},
        "nvlinks": {str(peer): link.nvlinks for peer, link in sorted(gpu.links.items()) if link.nvlinks},
    }
    if gpu.mig is not None:
        body["mig"] = encode_mig(gpu.mig)
    return body


def decode(text: str) -> NodeInventory:
    """Parse an annotation value; raise ``InventoryFormatError`` saying what is wrong."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION} must be a JSON object, got {type(raw).__name__}")
    version = raw.get("version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise InventoryFormatError(
            f"{INVENTORY_ANNOTATION} has version {version!r}; this reader understands version "
            f"{FORMAT_VERSION} only (upgrade the reader, or the agent on that node)"
        )
    gpus = _field(raw, "gpus", list, "")
    return NodeInventory(
        node=_field(raw, "node", str, ""),
        heartbeat=parse_time(_field(raw, "heartbeat", str, "")),
        memory_scaling=float(_number(raw, "memoryScaling", "")),
        gpus=tuple(_decode_gpu(g, f"gpus[{i}].") for i, g in enumerate(gpus)),
    )


def _decode_gpu(raw: object, where: str) -> GpuEntry:
    if not isinstance(raw, dict):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where[:-1]} must be an object")
    numa = raw.get("numa")
    if numa is not None and (not isinstance(numa, int) or isinstance(numa, bool)):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}numa must be an integer or null")
    levels = _field(raw, "links", dict, where)
    nvlinks = raw.get("nvlinks") or {}
    if not isinstance(nvlinks, dict):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}nvlinks must be an object")
    links: dict[int, Link] = {}
    for peer, level in levels.items():
        if not _PEER.fullmatch(peer) or not isinstance(level, str) or level not in TopologyLevel.__members__:
            raise InventoryFormatError(
                f"{INVENTORY_ANNOTATION}: {where}links[{peer!r}] = {level!r}: expected a GPU index "
                f"and one of {', '.join(TopologyLevel.__members__)}"
            )
        count = nvlinks.get(peer, 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}nvlinks[{peer!r}] must be a count")
        links[int(peer)] = Link(TopologyLevel[level], count)
    mig = None
    if raw.get("mig") is not None:
        try:
            mig = decode_mig(raw["mig"])
        except ValueError as err:
            raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}mig: {err}") from err
    return GpuEntry(
        index=_int(raw, "index", where),
        uuid=_field(raw, "uuid", str, where),
        model=_field(raw, "model", str, where),
        memory_mib=_int(raw, "memoryMiB", where),
        schedulable_mib=_int(raw, "schedulableMiB", where),
        numa=numa,
        healthy=_field(raw, "healthy", bool, where),
        links=links,
        cores=_int(raw, "cores", where),
        mig=mig,
    )


def _field(raw: Mapping[str, Any], key: str, kind: type[_T], where: str) -> _T:
    value = raw.get(key)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        got = "nothing" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)
        raise InventoryFormatError(
            f"{INVENTORY_ANNOTATION}: {where}{key} must be {_JSON_KINDS[kind]}, got {got}"
        )
    return value


def _int(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = _field(raw, key, int, where)
    if value < 0:
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}{key} must not be negative")
    return value


def _number(raw: Mapping[str, Any], key: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}{key} must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range: JSON allows 10**400
        number = math.inf
    if not math.isfinite(number):
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: {where}{key} must be a finite number")
    return number


def format_time(wall: float) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as err:
        raise InventoryFormatError(
            f"{INVENTORY_ANNOTATION}: heartbeat {text!r} is not an RFC 3339 time"
        ) from err
    if parsed.tzinfo is None:
        raise InventoryFormatError(f"{INVENTORY_ANNOTATION}: heartbeat {text!r} has no time zone")
    return parsed.timestamp()


def label_value(text: str) -> str:
    """A valid label value: spaces and other invalid characters as '-', at most 63
    characters, starting and ending alphanumeric (empty if nothing is left)."""
    value = _LABEL_INVALID.sub("-", text.strip())[:_LABEL_VALUE_MAX]
    return value.strip("-_.")


def gpu_labels(gpus: Sequence[GpuInfo]) -> dict[str, str | None]:
    """GFD's labels from the lowest-index GPU (as GFD does on mixed nodes); ``None`` removes a
    label (a node with no GPUs must not keep stale ones)."""
    if not gpus:
        return dict.fromkeys((PRODUCT_LABEL, COUNT_LABEL, MEMORY_LABEL))
    first = min(gpus, key=lambda g: g.index)
    return {
        PRODUCT_LABEL: label_value(first.model) or None,
        COUNT_LABEL: str(len(gpus)),
        MEMORY_LABEL: str(first.memory_mib),
    }
