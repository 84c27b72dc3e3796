"""Topology half of the NVML backend: PCI bus ids, sysfs NUMA lookup, PCIe levels, NVLinks.

Functions here call the NVML module they are given. ``NVMLError`` either propagates or is
raised inside the error-translating context managers the backend passes in.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from agent.platform.gpu.inventory import Link, Topology, TopologyLevel

log = logging.getLogger("agent.platform.gpu.nvml")


def text(value: Any) -> str:
    """NVML strings as ``str``: older bindings return ``bytes`` for names, UUIDs and bus ids."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _error_code(err: Any) -> int:
    return int(getattr(err, "value", -1))


def _lost_codes(nvml: ModuleType) -> set[int]:
    return {int(nvml.NVML_ERROR_GPU_IS_LOST), int(nvml.NVML_ERROR_RESET_REQUIRED)}


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` -> ``0000:3b:00.0``, the form sysfs uses.

    NVML pads the PCI domain to 8 hex digits in ``busId`` but to 4 in ``busIdLegacy`` and
    in some NVLink remote infos, so bus ids are compared in this form only.
    """
    raw = bus_id.strip().lower()
    parts = raw.split(":")
    try:
        if len(parts) == 3:
            domain, bus, devfn = int(parts[0], 16), int(parts[1], 16), parts[2]
        elif len(parts) == 2:
            domain, bus, devfn = 0, int(parts[0], 16), parts[1]
        else:
            return raw
        dev, fn = devfn.split(".")
        return f"{domain:04x}:{bus:02x}:{int(dev, 16):02x}.{int(fn, 16):x}"
    except ValueError:
        return raw


def sysfs_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The NUMA node the kernel reports for a PCI device; ``None`` when unknown (-1)."""
    path = sysfs_root / "bus" / "pci" / "devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError) as err:
        log.debug("no NUMA node for %s from %s: %s", bus_id, path, err)
        return None
    return node if node >= 0 else None


def numa_node(nvml: ModuleType, handle: Any, bus_id: str, sysfs_root: Path) -> int | None:
    """NVML's NUMA node of the GPU, else the kernel's; ``None`` when neither knows."""
    get_numa = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)  # absent in old bindings
    if get_numa is not None:
        try:
            node = int(get_numa(handle))
        except nvml.NVMLError as err:
            if _error_code(err) in _lost_codes(nvml):
                raise
            log.debug("NVML has no NUMA node for %s (%s); reading sysfs", bus_id, err)
        else:
            return node if node >= 0 else None
    return sysfs_numa_node(sysfs_root, bus_id)


def level_map(nvml: ModuleType) -> dict[int, TopologyLevel]:
    """NVML's ``nvmlGpuTopologyLevel_t`` values to ``TopologyLevel``."""
    return {
        int(nvml.NVML_TOPOLOGY_INTERNAL): TopologyLevel.BOARD,
        int(nvml.NVML_TOPOLOGY_SINGLE): TopologyLevel.SINGLE_SWITCH,
        int(nvml.NVML_TOPOLOGY_MULTIPLE): TopologyLevel.MULTIPLE_SWITCH,
        int(nvml.NVML_TOPOLOGY_HOSTBRIDGE): TopologyLevel.HOSTBRIDGE,
        int(nvml.NVML_TOPOLOGY_NODE): TopologyLevel.NODE,
        int(nvml.NVML_TOPOLOGY_SYSTEM): TopologyLevel.SYSTEM,
    }


@dataclass
class NvLinkScan:
    """One GPU's active NVLinks: per peer GPU index, plus links that end at an NVSwitch."""

    direct: Counter[int] = field(default_factory=Counter)
    switch_links: int = 0


def scan_nvlinks(nvml: ModuleType, handle: Any, own_index: int, index_by_bus: dict[str, int]) -> NvLinkScan:
    """Walk the links of one GPU. Raises ``nvml.NVMLError`` for errors other than "no such link"."""
    no_link = {int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_INVALID_ARGUMENT)}
    unsupported = {int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)}
    switch_type = int(nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
    # Old bindings and pre-NVSwitch drivers lack the remote device type; fall back to bus ids.
    get_type = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    scan = NvLinkScan()
    for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as err:
            if _error_code(err) in no_link:
                break  # links are numbered densely; the first missing one ends the list
            raise
        if int(state) != int(nvml.NVML_FEATURE_ENABLED):
            continue
        if get_type is not None:
            try:
                if int(get_type(handle, link)) == switch_type:
                    scan.switch_links += 1
                    continue
            except nvml.NVMLError as err:
                if _error_code(err) not in unsupported:
                    raise
                get_type = None  # the driver cannot tell; do not ask again for this GPU
        try:
            remote = text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except nvml.NVMLError as err:
            if _error_code(err) in no_link:
                continue  # a link without a readable far end counts for no pair
            raise
        peer = index_by_bus.get(normalize_bus_id(remote))
        if peer is not None and peer != own_index:
            scan.direct[peer] += 1
    return scan


def read_topology(
    nvml: ModuleType,
    handles: Sequence[Any],
    bus_ids: Sequence[str],
    call: Callable[[int], AbstractContextManager[None]],
    pair_call: Callable[[int, int], AbstractContextManager[None]],
) -> Topology:
    """PCIe level and NVLink count of every GPU pair.

    ``call(i)`` / ``pair_call(a, b)`` wrap NVML calls about GPU ``i`` / GPUs ``a`` and ``b``
    and translate ``NVMLError`` into the project's errors.
    """
    levels = level_map(nvml)
    by_bus = {normalize_bus_id(bus): i for i, bus in enumerate(bus_ids)}
    scans: list[NvLinkScan] = []
    for i, handle in enumerate(handles):
        with call(i):
            scans.append(scan_nvlinks(nvml, handle, i, by_bus))
    links: dict[tuple[int, int], Link] = {}
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            with pair_call(a, b):
                level = _common_ancestor(nvml, handles[a], handles[b], levels)
                # Each end sees the same links; take the larger count in case one scan was short.
                nvlinks = max(scans[a].direct[b], scans[b].direct[a])
                if (
                    scans[a].switch_links
                    and scans[b].switch_links
                    and _p2p_over_nvlink(nvml, handles[a], handles[b])
                ):
                    # Through NVSwitches every pair can use all links of the narrower GPU.
                    nvlinks += min(scans[a].switch_links, scans[b].switch_links)
            links[(a, b)] = Link(level, nvlinks)
    return Topology(links)


def _common_ancestor(nvml: ModuleType, a: Any, b: Any, levels: dict[int, TopologyLevel]) -> TopologyLevel:
    try:
        raw = int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except nvml.NVMLError as err:
        if _error_code(err) != int(nvml.NVML_ERROR_NOT_SUPPORTED):
            raise
        # Virtual machines often hide the PCIe tree; assume the farthest level.
        log.debug("no PCIe topology between two GPUs (%s); taking SYSTEM", err)
        return TopologyLevel.SYSTEM
    level = levels.get(raw)
    if level is None:
        log.warning("unknown NVML topology level %d; taking SYSTEM", raw)
        return TopologyLevel.SYSTEM
    return level


def _p2p_over_nvlink(nvml: ModuleType, a: Any, b: Any) -> bool:
    try:
        status = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except nvml.NVMLError as err:
        if _error_code(err) in _lost_codes(nvml):
            raise
        log.debug("no NVLink P2P status between two GPUs (%s)", err)
        return False
    return int(status) == int(nvml.NVML_P2P_STATUS_OK)
