"""The ResourceSlice this node publishes as the DRA driver ``gpu.vcuda.io`` (resource.k8s.io/v1).

One slice per node, named ``<node>-gpu.vcuda.io``, holding the node's whole pool (pool name =
node name, ``resourceSliceCount`` 1): one device per *healthy* GPU, named ``gpu-<index>``
(agent/domain/dra.py), that many claims may share (``allowMultipleAllocations``, KEP-5075)
through two consumable capacities:

- ``cores``: 100 (as nvidia.com/vcuda-core); a request is 1..100 in steps of 1; a claim that
  does not ask for cores consumes the default, 100: the whole GPU.
- ``memory``: floor(GPU memory x deviceMemoryScaling) MiB, as bytes (``"<MiB>Mi"``); requests
  are rounded up to whole MiB; a claim that does not ask for memory consumes 0 and gets no
  memory quota, as a device-plugin pod without nvidia.com/vcuda-memory. (A validRange needs a
  default; "0" keeps a cores-only claim from locking the GPU's memory, which a default of the
  whole memory would do.)

Attributes follow what NVIDIA's DRA driver publishes for a GPU, so selectors carry over:
``type`` "gpu", ``uuid``, ``productName``, ``index``, ``minor``, ``driverVersion`` (a semantic
version, when known), and the standard ``resource.kubernetes.io/pciBusID`` and
``resource.kubernetes.io/numaNode`` (left out when the platform does not say).

A GPU on dynamic MIG adds KEP-4815 shapes (agent/domain/migpartition.py): its counter set in
a slice of its own (``<node>-gpu.vcuda.io-gpu-<index>-counters``), its placement devices after
the share devices, and its share device marked ``isolation: mig`` and consuming the whole set.
The pool then has several slices: the devices in slices of at most 64 (``<node>-gpu.vcuda.io``,
``-2``, ``-3`` ...) and the counter slices; ``resourceSliceCount`` counts them all. Without
dynamic MIG it is the one slice above.

Consumers must only use the slices of a pool's highest ``spec.pool.generation``, so the
publisher (agent/control/drapublisher.py) bumps it whenever the devices change; this module
only builds and compares contents.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.domain.dra import CORES, DRIVER, MEMORY, device_name
from agent.domain.ids import UNITS_PER_GPU
from agent.domain.migpartition import chunks, counter_set, isolated_share_device, placement_devices
from agent.domain.nodeinventory import schedulable_mib
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migprofiles import MigProduct

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"
DEVICE_TYPE = "gpu"
_NAME_MAX = 253  # a DNS subdomain
_STRING_MAX = 64  # an attribute's string value
_BDF = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_VERSION = re.compile(r"^([0-9]+)\.([0-9]+)(?:\.([0-9]+))?$")

# The spec fields the agent owns; a slice that differs in any of them is rewritten.
_OWNED = ("driver", "nodeName", "devices", "sharedCounters")


def slice_name(node: str, suffix: str = "") -> str:
    """``<node>-gpu.vcuda.io`` (``-<suffix>`` after it for the pool's other slices); a node
    name too long for that is cut and made unique by a hash."""
    tail = f"{DRIVER}-{suffix}" if suffix else DRIVER
    name = f"{node}-{tail}"
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    keep = _NAME_MAX - len(tail) - len(digest) - 2
    return f"{node[:keep].rstrip('.-')}-{digest}-{tail}"


@dataclass(frozen=True)
class SliceContent:
    """One slice of the pool: devices or shared counters (never both)."""

    name: str
    devices: tuple[Mapping[str, Any], ...] = ()
    counters: tuple[Mapping[str, Any], ...] = ()


def pool_contents(
    node: str, devices: Sequence[Mapping[str, Any]], counters: Sequence[Mapping[str, Any]] = ()
) -> list[SliceContent]:
    """The pool's slices: devices in chunks (the first one keeps the plain slice name), then a
    slice per counter set."""
    slices = [
        SliceContent(slice_name(node, "" if i == 0 else str(i + 1)), tuple(chunk))
        for i, chunk in enumerate(chunks(devices))
    ]
    slices += [SliceContent(slice_name(node, str(c["name"])), counters=(c,)) for c in counters]
    return slices


def gpu_device(gpu: GpuInfo, memory_mib: int, driver_version: str | None = None) -> dict[str, Any]:
    """The device of one GPU with ``memory_mib`` MiB to share."""
    attributes: dict[str, Any] = {
        "type": {"string": DEVICE_TYPE},
        "uuid": {"string": gpu.uuid[:_STRING_MAX]},
        "productName": {"string": gpu.model[:_STRING_MAX]},
        "index": {"int": gpu.index},
        "minor": {"int": gpu.minor},
    }
    version = semantic_version(driver_version or "")
    if version:
        attributes["driverVersion"] = {"version": version}
    bus_id = pci_bus_id(gpu.pci_bus_id)
    if bus_id:
        attributes[PCI_BUS_ID_ATTRIBUTE] = {"string": bus_id}
    if gpu.numa_node is not None and gpu.numa_node >= 0:  # -1: no NUMA affinity, never published
        attributes[NUMA_NODE_ATTRIBUTE] = {"int": gpu.numa_node}
    return {
        "name": device_name(gpu.index),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            CORES: {
                "value": str(UNITS_PER_GPU),
                "requestPolicy": {
                    "default": str(UNITS_PER_GPU),
                    "validRange": {"min": "1", "max": str(UNITS_PER_GPU), "step": "1"},
                },
            },
            MEMORY: {
                "value": f"{memory_mib}Mi",
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1Mi"}},
            },
        },
    }


def desired_devices(
    gpus: Sequence[GpuInfo],
    healthy: Mapping[int, bool],
    scaling: float,
    driver_version: str | None = None,
    dynamic: Mapping[int, MigProduct] | None = None,
) -> list[dict[str, Any]]:
    """The devices to publish, by GPU index: unhealthy GPUs (and any without a whole MiB to
    share, which no memory policy could describe) are left out. A GPU missing from ``healthy``
    counts as healthy, as in nodeinventory.memory_capacity_mib. ``dynamic``: the GPUs on
    dynamic MIG (ready for it) and their MIG product: their share device is isolated and
    their placement devices follow every share device."""
    dynamic = dynamic or {}
    devices, placements = [], []
    for gpu in sorted(gpus, key=lambda g: g.index):
        mib = schedulable_mib(gpu.memory_mib, scaling)
        if not (healthy.get(gpu.index, True) and mib >= 1):
            continue
        device = gpu_device(gpu, mib, driver_version)
        product = dynamic.get(gpu.index)
        if product is None:
            devices.append(device)
            continue
        devices.append(isolated_share_device(device, gpu.index))
        placements += placement_devices(gpu, product, semantic_version(driver_version or "") or "")
    return devices + placements


def desired_counters(devices: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The counter sets the devices consume, in order: one per dynamic GPU published."""
    names = dict.fromkeys(str(c["counterSet"]) for d in devices for c in d.get("consumesCounters") or ())
    return [counter_set(int(name.split("-")[1])) for name in names]


def node_owner(node: str, uid: str) -> dict[str, Any]:
    """The ownerReference to this node's Node, as k8s.io/dynamic-resource-allocation's kubelet
    plugin helper sets it: the garbage collector deletes the slice with the Node."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}


def build_slice(
    node: str,
    devices: Sequence[Mapping[str, Any]],
    generation: int,
    resource_version: str | None = None,
    node_uid: str = "",
    *,
    content: SliceContent | None = None,
    count: int = 1,
) -> dict[str, Any]:
    """The whole ResourceSlice; ``resource_version`` makes a replacement conditional;
    ``node_uid`` (when known) makes the Node its owner. ``content``: one slice of a pool of
    ``count`` slices (its devices or counters; ``devices`` is then ignored)."""
    content = content or SliceContent(slice_name(node), tuple(devices))
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
    }
    if content.counters:
        spec["sharedCounters"] = [dict(c) for c in content.counters]
    else:
        spec["devices"] = [dict(d) for d in content.devices]
    metadata: dict[str, Any] = {
        "name": content.name,
        "labels": {"app.kubernetes.io/managed-by": "vcuda-agent"},
    }
    if resource_version:
        metadata["resourceVersion"] = resource_version
    if node_uid:
        metadata["ownerReferences"] = [node_owner(node, node_uid)]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": spec,
    }


def pool_generation(obj: Mapping[str, Any]) -> int:
    """spec.pool.generation of a slice read back (0 when missing or malformed)."""
    pool = (obj.get("spec") or {}).get("pool") or {}
    generation = pool.get("generation")
    return generation if isinstance(generation, int) and not isinstance(generation, bool) else 0


def is_owned(obj: Mapping[str, Any], node: str, node_uid: str) -> bool:
    """Whether a slice read back has exactly the ownerReference ``build_slice`` gives it
    (trivially so while the Node's uid is unknown)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences")
    return not node_uid or refs == [node_owner(node, node_uid)]


def is_current(
    obj: Mapping[str, Any],
    node: str,
    devices: Sequence[Mapping[str, Any]],
    *,
    content: SliceContent | None = None,
    count: int = 1,
) -> bool:
    """Whether a slice read back already says what we would publish (generation aside)."""
    spec = obj.get("spec") or {}
    want = build_slice(node, devices, 0, content=content, count=count)["spec"]
    pool = spec.get("pool") or {}
    return all(spec.get(k) == want.get(k) for k in _OWNED) and (
        pool.get("name"),
        pool.get("resourceSliceCount"),
    ) == (node, count)


def pci_bus_id(text: str) -> str | None:
    """NVML's ``00000000:3B:00.0`` as the standard attribute wants it (extended BDF, lower
    case, 4-digit domain when it fits): ``0000:3b:00.0``; None for anything else."""
    match = _BDF.match(text.strip())
    if not match:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def semantic_version(text: str) -> str | None:
    """A driver version as semver 2.0: ``535.104.05`` → ``535.104.5`` (no leading zeros),
    ``550.54`` → ``550.54.0``; None when it is not numeric."""
    match = _VERSION.match(text.strip())
    if not match:
        return None
    major, minor, patch = match.groups()
    return f"{int(major)}.{int(minor)}.{int(patch or 0)}"
