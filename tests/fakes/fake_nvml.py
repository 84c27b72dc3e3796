"""Emulates NVML's Python binding (``pynvml``) in memory, for tests on machines without a GPU.

``FakeNvml`` is a module object exposing the ``pynvml`` functions the NVML backend calls, with
the same names, arguments and return shapes as nvidia-ml-py 13:

* strings (names, UUIDs) come back as ``str``; structs are the binding's own ctypes structs
  (``nvmlPciInfo_t``, ``c_nvmlMemory_t``, ``c_nvmlUtilization_t``, ``c_nvmlEventData_t``,
  ``c_nvmlProcessUtilizationSample_t``) and running processes are ``nvmlFriendlyObject``s
  with ``usedGpuMemory`` ``None`` when not available;
* device and event-set handles are ctypes pointers (``c_nvmlDevice_t``), so, as with the real
  library, a handle in event data is a *different* pointer object to the same address;
* errors are the real ``pynvml.NVMLError(code)``, i.e. its per-code subclasses;
* the constants (``NVML_*``, ``nvmlEventType*``, ``NVMLError*``) are pynvml's own.

Test controls: ``inject_xid``, ``lose``, ``set_process_samples``, ``set_processes``,
``set_utilization``, ``set_utilization_samples``, ``fail_init``, ``fail_call``;
``call_counts`` counts calls by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

_DEVICE_BASE = 0x7F00_0000_1000  # fake addresses for device handles, one page apart
_EVENT_SET_BASE = 0x7F00_8000_1000
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG


@dataclass
class FakeNvLink:
    """One NVLink of a GPU: the PCI bus id and kind of device at its far end."""

    remote_bus_id: str
    remote_type: int = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    active: bool = True

    @classmethod
    def to_switch(cls, switch_bus_id: str, active: bool = True) -> FakeNvLink:
        return cls(switch_bus_id, pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, active)


@dataclass
class FakeGpu:
    """Description of one emulated GPU."""

    uuid: str
    bus_id: str  # as NVML's busId: "00000000:3B:00.0"
    minor: int
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    numa_node: int | None = 0  # None: nvmlDeviceGetNumaNodeId says NOT_SUPPORTED
    nvlinks: list[FakeNvLink] = field(default_factory=list)
    supported_events: int = (
        pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeXidCriticalError
    )
    remote_type_supported: bool = True  # False: nvmlDeviceGetNvLinkRemoteDeviceType unsupported


@dataclass
class _Device:
    spec: FakeGpu
    lost: bool = False
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    utilization: tuple[int, int] = (0, 0)
    utilization_stamps: list[int] = field(default_factory=list)  # µs of device utilization samples
    utilization_values: list[int] | None = None  # their values (None: utilization[0] for each)


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # device index -> event mask
    queue: deque[tuple[int, int, int, int]] = field(default_factory=deque)  # (index, type, data, GI id)
    freed: bool = False


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _pci_info(bus_id: str) -> pynvml.nvmlPciInfo_t:
    domain, bus, devfn = bus_id.split(":")
    device = devfn.split(".")[0]
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id
    info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{devfn}"
    info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(device, 16)
    return info


@contextlib.contextmanager
def _version_mismatch_as_binding_does(name: str) -> Iterator[None]:
    """pynvml's ``throwOnVersionMismatch``: FUNCTION_NOT_FOUND becomes NVMLLibraryMismatchError."""
    try:
        yield
    except pynvml.NVMLError_FunctionNotFound as err:
        raise pynvml.NVMLLibraryMismatchError(f"Unversioned function called: use {name}_v2") from err


class FakeNvml(types.ModuleType):
    """A module-like NVML emulator over ``gpus``.

    ``topology`` maps GPU index pairs (either order) to ``NVML_TOPOLOGY_*`` values; unlisted
    pairs are ``NVML_TOPOLOGY_SYSTEM``. ``missing`` names binding functions to hide, as an
    older nvidia-ml-py would not have them; ``driver_lacks`` names functions the binding has
    but the driver's library does not (``_nvmlGetFunctionPointer`` and the call itself
    raise FUNCTION_NOT_FOUND, as with a driver older than the function).
    """

    _missing: frozenset[str] = frozenset()

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        topology: Mapping[tuple[int, int], int] | None = None,
        missing: Iterable[str] = (),
        driver_lacks: Iterable[str] = (),
    ) -> None:
        super().__init__("pynvml", "fake NVML for tests")
        for name, value in vars(pynvml).items():
            if name.startswith(
                ("NVML_", "NVMLError", "NVMLLibrary", "nvmlEventType", "c_nvmlSetMemoryLimits")
            ):
                setattr(self, name, value)
        self._missing = frozenset(missing)
        self._driver_lacks = frozenset(driver_lacks)
        self.memory_limits: dict[int, dict[str, tuple[int, int]]] = {}  # GPU -> cgroup -> (soft, hard)
        self._cond = threading.Condition()
        self._devices = [_Device(spec) for spec in gpus]
        self._topology = {tuple(sorted(k)): v for k, v in (topology or {}).items()}
        self._event_sets: dict[int, _EventSet] = {}
        self._init_failure: int | None = None
        self._failures: dict[tuple[str, int | None], list[int]] = {}
        self.init_count = 0  # nvmlInit calls not yet matched by nvmlShutdown
        self.shutdown_calls = 0
        self.call_counts: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "_missing"):
            raise AttributeError(f"module 'pynvml' has no attribute '{name}'")
        return super().__getattribute__(name)

    # --- test controls ----------------------------------------------------------------

    def fail_init(self, code: int | None) -> None:
        """Make ``nvmlInit`` raise ``NVMLError(code)`` (``None``: succeed again)."""
        self._init_failure = code

    def fail_call(self, name: str, code: int, index: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` calls of ``name`` (on GPU ``index``, or any) raise ``code``."""
        with self._cond:
            self._failures.setdefault((name, index), []).extend([code] * times)

    def inject_xid(self, index: int, xid: int, gpu_instance: int | None = None) -> int:
        """Post an XID on GPU ``index`` (``gpu_instance``: attributed to that MIG GPU
        instance); returns how many event sets it was delivered to."""
        gi = _NO_INSTANCE if gpu_instance is None else gpu_instance
        xid_type = pynvml.nvmlEventTypeXidCriticalError
        delivered = 0
        with self._cond:
            for event_set in self._event_sets.values():
                if not event_set.freed and event_set.registered.get(index, 0) & xid_type:
                    event_set.queue.append((index, xid_type, xid, gi))
                    delivered += 1
            self._cond.notify_all()
        return delivered

    def lose(self, index: int) -> None:
        """GPU ``index`` falls off the bus: calls on it, and waits on sets holding it, fail."""
        with self._cond:
            self._devices[index].lost = True
            self._cond.notify_all()

    def set_process_samples(self, index: int, samples: Iterable[tuple[int, int, int, int]]) -> None:
        """Samples as ``(pid, timestamp_us, sm_util, mem_util)``."""
        with self._cond:
            self._devices[index].samples = list(samples)

    def set_processes(
        self,
        index: int,
        compute: Iterable[tuple[int, int | None]] = (),
        graphics: Iterable[tuple[int, int | None]] = (),
    ) -> None:
        """Running processes as ``(pid, used_bytes)``; ``None`` bytes: not available."""
        with self._cond:
            self._devices[index].compute = list(compute)
            self._devices[index].graphics = list(graphics)

    def set_utilization(self, index: int, gpu: int, memory: int = 0) -> None:
        with self._cond:
            self._devices[index].utilization = (gpu, memory)

    def set_utilization_samples(
        self, index: int, stamps_us: Sequence[int], values: Sequence[int] | None = None
    ) -> None:
        """Timestamps of the device's utilization samples (nvmlDeviceGetSamples) and, one per
        timestamp, their values (None: the device's current ``set_utilization`` for each)."""
        if values is not None and len(values) != len(stamps_us):
            raise ValueError(f"{len(values)} values for {len(stamps_us)} timestamps")
        with self._cond:
            self._devices[index].utilization_stamps = list(stamps_us)
            self._devices[index].utilization_values = None if values is None else list(values)

    @property
    def live_event_sets(self) -> int:
        with self._cond:
            return sum(1 for s in self._event_sets.values() if not s.freed)

    # --- internals ----------------------------------------------------------------------

    def _enter(self, name: str, index: int | None = None) -> None:
        """Bookkeeping every binding call does first; call with ``_cond`` held."""
        self.call_counts[name] += 1
        if self.init_count <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        for key in ((name, index), (name, None)):
            queued = self._failures.get(key)
            if queued:
                raise _error(queued.pop(0))

    def _index(self, handle: Any) -> int:
        if not isinstance(handle, pynvml.c_nvmlDevice_t):
            raise ctypes.ArgumentError(f"expected c_nvmlDevice_t, got {handle!r}")
        index, rest = divmod(_address(handle) - _DEVICE_BASE, 0x1000)
        if rest or not 0 <= index < len(self._devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def _device(self, name: str, handle: Any) -> tuple[int, _Device]:
        """Resolve a handle for the call ``name``: bookkeeping, then a lost GPU fails."""
        index = self._index(handle)
        self._enter(name, index)
        device = self._devices[index]
        if device.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return index, device

    def _pair(self, name: str, handle1: Any, handle2: Any) -> tuple[int, int]:
        a, b = self._index(handle1), self._index(handle2)
        self._enter(name, a)
        if self._devices[a].lost or self._devices[b].lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if a == b:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return a, b

    def _event_set(self, event_set: Any) -> _EventSet:
        if not isinstance(event_set, pynvml.c_nvmlEventSet_t):
            raise ctypes.ArgumentError(f"expected c_nvmlEventSet_t, got {event_set!r}")
        found = self._event_sets.get(_address(event_set))
        if found is None or found.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found

    @staticmethod
    def _handle_for(index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(_DEVICE_BASE + index * 0x1000), pynvml.c_nvmlDevice_t)

    def _link(self, name: str, handle: Any, link: int) -> tuple[int, FakeNvLink]:
        index, device = self._device(name, handle)
        links = device.spec.nvlinks
        if not links:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, links[link]

    # --- init / shutdown ----------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._cond:
            self.call_counts["nvmlInit"] += 1
            if self._init_failure is not None:
                raise _error(self._init_failure)
            self.init_count += 1

    def nvmlShutdown(self) -> None:
        with self._cond:
            self._enter("nvmlShutdown")
            self.init_count -= 1
            self.shutdown_calls += 1

    # --- inventory ----------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        with self._cond:
            self._enter("nvmlDeviceGetCount")
            return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._cond:
            self._enter("nvmlDeviceGetHandleByIndex", index)
            if not 0 <= index < len(self._devices):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if self._devices[index].lost:
                raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
            return self._handle_for(index)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._cond:
            return self._device("nvmlDeviceGetName", handle)[1].spec.name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._cond:
            return self._device("nvmlDeviceGetUUID", handle)[1].spec.uuid

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        with self._cond:
            return self._device("nvmlDeviceGetMinorNumber", handle)[1].spec.minor

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        with self._cond:
            return self._device("nvmlDeviceGetIndex", handle)[0]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        with self._cond:
            device = self._device("nvmlDeviceGetMemoryInfo", handle)[1]
            total = device.spec.memory_mib * 1024 * 1024
            used = min(total, sum(b or 0 for _, b in device.compute + device.graphics))
            memory = pynvml.c_nvmlMemory_v2_t() if version else pynvml.c_nvmlMemory_t()
            if version:
                memory.version = version
            memory.total, memory.used, memory.free = total, used, total - used
            return memory

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        with self._cond:
            return _pci_info(self._device("nvmlDeviceGetPciInfo", handle)[1].spec.bus_id)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        with self._cond:
            node = self._device("nvmlDeviceGetNumaNodeId", handle)[1].spec.numa_node
            if node is None:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return node

    # --- topology -----------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        with self._cond:
            a, b = self._pair("nvmlDeviceGetTopologyCommonAncestor", device1, device2)
            return int(self._topology.get((min(a, b), max(a, b)), pynvml.NVML_TOPOLOGY_SYSTEM))

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        with self._cond:
            nvlink = self._link("nvmlDeviceGetNvLinkState", device, link)[1]
            return int(pynvml.NVML_FEATURE_ENABLED if nvlink.active else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> pynvml.nvmlPciInfo_t:
        with self._cond:
            nvlink = self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)[1]
            if not nvlink.active:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return _pci_info(nvlink.remote_bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        with self._cond:
            index, nvlink = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if not self._devices[index].spec.remote_type_supported:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return nvlink.remote_type

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        with self._cond:
            a, b = self._pair("nvmlDeviceGetP2PStatus", device1, device2)
            dev_a, dev_b = self._devices[a], self._devices[b]
            if p2pIndex != pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
                return int(pynvml.NVML_P2P_STATUS_OK)  # PCIe peer access works between any pair
            direct = any(
                link.active and link.remote_bus_id == dev_b.spec.bus_id for link in dev_a.spec.nvlinks
            )
            switched = all(
                any(
                    link.active and link.remote_type == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
                    for link in dev.spec.nvlinks
                )
                for dev in (dev_a, dev_b)
            )
            ok, refused = pynvml.NVML_P2P_STATUS_OK, pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
            return int(ok if direct or switched else refused)

    # --- events -------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        with self._cond:
            return self._device("nvmlDeviceGetSupportedEventTypes", handle)[1].spec.supported_events

    def nvmlEventSetCreate(self) -> Any:
        with self._cond:
            self._enter("nvmlEventSetCreate")
            address = _EVENT_SET_BASE + len(self._event_sets) * 0x1000
            self._event_sets[address] = _EventSet()
            return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._cond:
            index, device = self._device("nvmlDeviceRegisterEvents", handle)
            event_set = self._event_set(eventSet)
            if eventTypes & ~device.spec.supported_events:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            event_set.registered[index] = event_set.registered.get(index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> pynvml.c_nvmlEventData_t:
        with self._cond:
            self._enter("nvmlEventSetWait")
            event_set = self._event_set(eventSet)

            def lost() -> bool:
                return any(self._devices[i].lost for i in event_set.registered)

            self._cond.wait_for(lambda: bool(event_set.queue) or lost() or event_set.freed, timeoutms / 1000)
            if event_set.queue:
                index, event_type, event_data, gi = event_set.queue.popleft()
                data = pynvml.c_nvmlEventData_t()
                data.device = self._handle_for(index)  # a new pointer object, as from NVML
                data.eventType, data.eventData = event_type, event_data
                data.gpuInstanceId, data.computeInstanceId = gi, _NO_INSTANCE
                return data
            if lost():
                raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
            if event_set.freed:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            raise _error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._cond:
            self._enter("nvmlEventSetFree")
            self._event_set(eventSet).freed = True
            self._cond.notify_all()

    # --- processes and utilization -----------------------------------------------------

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        with self._cond:
            device = self._device("nvmlDeviceGetProcessUtilization", handle)[1]
            newer = [s for s in device.samples if s[1] > timeStamp]
            if not newer:
                raise _error(pynvml.NVML_ERROR_NOT_FOUND)
            samples = (pynvml.c_nvmlProcessUtilizationSample_t * len(newer))()
            for sample, (pid, ts, sm, mem) in zip(samples, newer, strict=True):
                sample.pid, sample.timeStamp, sample.smUtil, sample.memUtil = pid, ts, sm, mem
            return list(samples[0 : len(newer)])  # the binding slices the ctypes array too

    @staticmethod
    def _process_objects(procs: list[tuple[int, int | None]]) -> list[Any]:
        objects = []
        for pid, used in procs:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid, info.gpuInstanceId, info.computeInstanceId = pid, _NO_INSTANCE, _NO_INSTANCE
            info.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # what the binding does for "not available"
            objects.append(obj)
        return objects

    # --- driver memory limits -----------------------------------------------------------

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        if name in self._driver_lacks:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return getattr(self, name)

    def nvmlDeviceSetMemoryLimits_v1(self, device: Any, limits: Any) -> None:
        """Root only and cgroup v2 on a real driver; here: recorded per GPU and cgroup."""
        with self._cond:
            if "nvmlDeviceSetMemoryLimits_v1" in self._driver_lacks:
                raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            index = self._device("nvmlDeviceSetMemoryLimits_v1", device)[0]
            if not isinstance(limits, pynvml.c_nvmlSetMemoryLimits_v1_t) or not limits.nameSpace:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            name = limits.nameSpace  # pynvml's structures hand c_char_p fields out as str
            cgroup = name.decode() if isinstance(name, bytes) else str(name)
            self.memory_limits.setdefault(index, {})[cgroup] = (int(limits.softLimit), int(limits.hardLimit))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        with self._cond, _version_mismatch_as_binding_does("nvmlDeviceGetComputeRunningProcesses"):
            device = self._device("nvmlDeviceGetComputeRunningProcesses", handle)[1]
            return self._process_objects(device.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        with self._cond, _version_mismatch_as_binding_does("nvmlDeviceGetGraphicsRunningProcesses"):
            device = self._device("nvmlDeviceGetGraphicsRunningProcesses", handle)[1]
            return self._process_objects(device.graphics)

    def nvmlDeviceGetSamples(self, handle: Any, samplingType: int, timeStamp: int) -> tuple[int, list[Any]]:
        with self._cond:
            device = self._device("nvmlDeviceGetSamples", handle)[1]
            if samplingType != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            values = device.utilization_values or [device.utilization[0]] * len(device.utilization_stamps)
            newer = [(t, v) for t, v in zip(device.utilization_stamps, values, strict=True) if t > timeStamp]
            if not newer:
                raise _error(pynvml.NVML_ERROR_NOT_FOUND)
            samples = (pynvml.c_nvmlSample_t * len(newer))()
            for sample, (stamp, value) in zip(samples, newer, strict=True):
                sample.timeStamp = stamp
                sample.sampleValue.uiVal = value
            return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, list(samples[0 : len(newer)])

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> pynvml.c_nvmlUtilization_t:
        with self._cond:
            device = self._device("nvmlDeviceGetUtilizationRates", handle)[1]
            rates = pynvml.c_nvmlUtilization_t()
            rates.gpu, rates.memory = device.utilization
            return rates
