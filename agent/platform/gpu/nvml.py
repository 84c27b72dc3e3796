"""``GpuBackend`` on top of NVML (the ``pynvml`` binding from nvidia-ml-py).

The NVML module is passed in rather than imported, so tests drive the backend with an
in-memory fake and importing this file never loads ``libnvidia-ml``.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from agent.errors import (
    DeviceSamplesUnsupportedError,
    GpuLostError,
    MemoryLimitUnsupportedError,
    NoSuchGpuError,
    NvmlError,
    PlatformError,
)
from agent.platform.gpu.inventory import (
    DeviceEvent,
    DeviceSample,
    EventKind,
    GpuInfo,
    ProcessMemory,
    ProcessSample,
    Topology,
)
from agent.platform.gpu.migcontrol import MigControl, pynvml_placement
from agent.platform.gpu.migstate import MigInfo
from agent.platform.gpu.nvml_library import init_hint, load_from_driver_root
from agent.platform.gpu.nvml_limits import limits_support, mps_client_processes, set_cgroup_limit
from agent.platform.gpu.nvml_mig import MIG_MINORS, read_mig, read_minors
from agent.platform.gpu.nvml_topology import numa_node, read_topology, text

log = logging.getLogger("agent.platform.gpu.nvml")

# NVML_ERROR_LIBRARY_NOT_FOUND; needed before any NVML module is available to read it from.
_LIBRARY_NOT_FOUND = 12
_NO_INSTANCE = 0xFFFFFFFF  # nvmlEventData_t.gpuInstanceId of an event that is not an instance's
_MIB = 1024 * 1024


def _handle_key(handle: Any) -> int:
    """Identity of a device handle. ``pynvml`` handles are ctypes pointers, which compare by
    object identity, and event data carries a fresh pointer object; compare addresses."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)  # not a ctypes pointer (a stand-in handle): identity is all we have
    return int(address or 0)


class NvmlBackend:
    """GPUs as NVML reports them. Takes over an initialized NVML; ``close()`` shuts it down.

    Thread-safe: one thread may block in ``wait_events`` while others query processes.
    """

    def __init__(
        self, nvml: ModuleType, sysfs_root: Path = Path("/sys"), mig_minors: Path = MIG_MINORS
    ) -> None:
        self._nvml = nvml
        self._sysfs_root = sysfs_root
        self._mig_minors_path = mig_minors
        self._mig_minors: dict[str, int] | None = None  # read at the first MIG device
        self._lost_codes = {int(nvml.NVML_ERROR_GPU_IS_LOST), int(nvml.NVML_ERROR_RESET_REQUIRED)}
        # pynvml raises this (not an NVMLError) when the driver's NVML lacks a function it calls.
        self._mismatch: type[Exception] | tuple[()] = getattr(nvml, "NVMLLibraryMismatchError", ())
        self._lock = threading.Lock()  # guards the fields below the wait lock
        self._changed = threading.Condition(self._lock)  # lost GPUs or close
        self._wait_lock = threading.Lock()  # serializes nvmlEventSetWait and the event set
        self._closed = False
        self._lost: set[int] = set()
        self._lost_reported: set[int] = set()
        self._topology: Topology | None = None
        self._handles: list[Any] = []
        self._gpus: tuple[GpuInfo, ...] = ()
        with self._call(None):
            count = int(nvml.nvmlDeviceGetCount())
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._gpus = tuple(self._read_info(i) for i in range(count))
        self._index_by_key = {_handle_key(h): i for i, h in enumerate(self._handles)}
        self._xid_capable = [i for i in range(count) if self._supports_xid(i)]
        self._event_set: Any = None
        self._registered: set[int] = set()
        with self._call(None):
            self._build_event_set()

    @property
    def name(self) -> str:
        return "nvml"

    def gpus(self) -> Sequence[GpuInfo]:
        return self._gpus

    # --- errors -------------------------------------------------------------------------

    @contextmanager
    def _call(self, index: int | None) -> Iterator[None]:
        """Translate ``NVMLError`` raised inside the block; ``index`` is the GPU asked about."""
        try:
            yield
        except self._nvml.NVMLError as err:
            code = int(err.value)
            if index is not None and code in self._lost_codes:
                self._mark_lost(index)
                raise GpuLostError(index, str(err)) from err
            raise NvmlError(code, str(err), index) from err
        except self._mismatch as err:
            code = int(self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            raise NvmlError(
                code, f"the driver's NVML is older than nvidia-ml-py expects: {err}", index
            ) from err

    def _mark_lost(self, index: int) -> None:
        with self._lock:
            if index not in self._lost:
                log.error("GPU %d is lost (fell off the bus or needs a reset)", index)
                self._lost.add(index)
                self._changed.notify_all()

    def _handle(self, index: int) -> Any:
        with self._lock:
            if self._closed:
                raise NvmlError(int(self._nvml.NVML_ERROR_UNINITIALIZED), "backend is closed")
        if not 0 <= index < len(self._handles):
            raise NoSuchGpuError(f"no GPU with index {index}; this node has {len(self._handles)}")
        return self._handles[index]

    # --- inventory ----------------------------------------------------------------------

    def _read_info(self, index: int) -> GpuInfo:
        nvml, handle = self._nvml, self._handles[index]
        with self._call(index):
            bus_id = text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            info = GpuInfo(
                index=index,
                uuid=text(nvml.nvmlDeviceGetUUID(handle)),
                model=text(nvml.nvmlDeviceGetName(handle)),
                memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
                minor=int(nvml.nvmlDeviceGetMinorNumber(handle)),
                pci_bus_id=bus_id,
                numa_node=numa_node(nvml, handle, bus_id, self._sysfs_root),
            )
        return info

    def _supports_xid(self, index: int) -> bool:
        nvml = self._nvml
        xid = int(nvml.nvmlEventTypeXidCriticalError)
        try:
            supported = int(nvml.nvmlDeviceGetSupportedEventTypes(self._handles[index]))
        except nvml.NVMLError as err:
            if int(err.value) in self._lost_codes:
                self._mark_lost(index)  # reported as LOST by the first wait_events
                return False
            log.warning("GPU %d: cannot read supported events (%s); no XID health", index, err)
            return False
        if not supported & xid:
            log.warning("GPU %d does not report XID errors; it has no XID health", index)
            return False
        return True

    def _build_event_set(self) -> None:
        """Create the event set and register XID events of every capable GPU not lost.

        Called with ``_wait_lock`` held (or during construction); raises ``NVMLError``.
        """
        nvml = self._nvml
        with self._lock:
            wanted = [i for i in self._xid_capable if i not in self._lost]
        if not wanted:
            return
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as err:
            if int(err.value) != int(nvml.NVML_ERROR_NOT_SUPPORTED):
                raise
            log.warning("NVML cannot create event sets here (%s); no XID health for any GPU", err)
            return
        registered: set[int] = set()
        try:
            for i in wanted:
                try:
                    nvml.nvmlDeviceRegisterEvents(
                        self._handles[i], int(nvml.nvmlEventTypeXidCriticalError), event_set
                    )
                except nvml.NVMLError as err:
                    if int(err.value) not in self._lost_codes:
                        raise
                    self._mark_lost(i)
                else:
                    registered.add(i)
        except BaseException:
            self._free_event_set(event_set)
            raise
        self._event_set, self._registered = event_set, registered

    def _free_event_set(self, event_set: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except self._nvml.NVMLError as err:
            log.warning("freeing the NVML event set failed: %s", err)

    # --- topology -----------------------------------------------------------------------

    def topology(self) -> Topology:
        with self._lock:
            if self._topology is not None:
                return self._topology
        handles = [self._handle(i) for i in range(len(self._handles))]  # raises once closed
        bus_ids = [g.pci_bus_id for g in self._gpus]
        topology = read_topology(self._nvml, handles, bus_ids, self._call, self._pair_call)
        with self._lock:
            self._topology = topology
        return topology

    @contextmanager
    def _pair_call(self, a: int, b: int) -> Iterator[None]:
        """Like ``_call`` for calls on two GPUs: a lost error is pinned on the one lost."""
        try:
            yield
        except self._nvml.NVMLError as err:
            code = int(err.value)
            if code in self._lost_codes:
                lost = a if self._probe(a) else b  # NVML does not say which end is gone
                self._mark_lost(lost)
                raise GpuLostError(lost, str(err)) from err
            raise NvmlError(code, f"GPUs {a},{b}: {err}") from err

    # --- health events ------------------------------------------------------------------

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        nvml = self._nvml
        with self._wait_lock:
            pending = self._take_unreported_lost()
            if pending:
                return pending
            if self._event_set is None:
                return self._idle(timeout_s)
            try:
                data = nvml.nvmlEventSetWait(self._event_set, max(0, int(timeout_s * 1000)))
            except nvml.NVMLError as err:
                code = int(err.value)
                if code == int(nvml.NVML_ERROR_TIMEOUT):
                    return []
                if code in self._lost_codes:
                    return self._after_lost_wait(timeout_s)
                raise NvmlError(code, f"waiting for events: {err}") from err
            return self._to_events(data)

    def _to_events(self, data: Any) -> list[DeviceEvent]:
        index = self._index_by_key.get(_handle_key(data.device))
        if index is None:
            log.warning("NVML event for a device not in the inventory: %s", data)
            return []
        if int(data.eventType) != int(self._nvml.nvmlEventTypeXidCriticalError):
            return []  # only XIDs are registered; anything else is not a health event
        xid = int(data.eventData)
        gi = int(getattr(data, "gpuInstanceId", _NO_INSTANCE))
        instance = None if gi == _NO_INSTANCE else gi  # an XID of a MIG GPU instance
        where = "" if instance is None else f" on GPU instance {instance}"
        detail = f"NVML reported Xid {xid}{where}"
        return [DeviceEvent(index, EventKind.XID, xid=xid, detail=detail, gpu_instance=instance)]

    def _after_lost_wait(self, timeout_s: float) -> list[DeviceEvent]:
        """The wait said a GPU is lost: find which, and stop waiting on it."""
        for i in range(len(self._handles)):
            if i not in self._lost_now():
                self._probe(i)
        if self._registered & self._lost_now():
            # The old set keeps failing while it holds a lost GPU; watch the others on a new one.
            old, self._event_set, self._registered = self._event_set, None, set()
            self._free_event_set(old)
            with self._call(None):
                self._build_event_set()
        events = self._take_unreported_lost()
        if not events:
            log.warning("NVML reported a lost GPU but every GPU answers; waiting out the timeout")
            return self._idle(timeout_s)
        return events

    def _lost_now(self) -> set[int]:
        with self._lock:
            return set(self._lost)

    def _probe(self, index: int) -> bool:
        """True when the GPU is lost (and records it)."""
        try:
            self._nvml.nvmlDeviceGetUUID(self._handles[index])
        except self._nvml.NVMLError as err:
            if int(err.value) not in self._lost_codes:
                log.debug("probing GPU %d: %s", index, err)
                return False
            self._mark_lost(index)
            return True
        return False

    def _idle(self, timeout_s: float) -> list[DeviceEvent]:
        """No event set to wait on: sleep until a GPU is found lost, close, or the timeout."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or bool(self._lost - self._lost_reported), max(0.0, timeout_s)
            )
        return self._take_unreported_lost()

    def _take_unreported_lost(self) -> list[DeviceEvent]:
        with self._lock:
            if self._closed:
                raise NvmlError(int(self._nvml.NVML_ERROR_UNINITIALIZED), "backend is closed")
            new = sorted(self._lost - self._lost_reported)
            self._lost_reported.update(new)
        return [DeviceEvent(i, EventKind.LOST, detail="GPU fell off the bus or needs a reset") for i in new]

    # --- per-process data ---------------------------------------------------------------

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        nvml, handle = self._nvml, self._handle(index)
        with self._call(index):
            try:
                raw = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
            except nvml.NVMLError as err:
                # NOT_FOUND is NVML's "no samples newer than since_us"; pynvml raises
                # NVMLError(SUCCESS) when the sizing call finds nothing at all.
                if int(err.value) in (int(nvml.NVML_ERROR_NOT_FOUND), int(nvml.NVML_SUCCESS)):
                    return []
                raise
        return [ProcessSample(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in raw]

    def process_memory(self, index: int) -> list[ProcessMemory]:
        nvml, handle = self._nvml, self._handle(index)
        with self._call(index):
            procs = [
                *nvml.nvmlDeviceGetComputeRunningProcesses(handle),
                *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
            ]
        procs += mps_client_processes(nvml, handle)  # under MPS: each client's own memory
        used: dict[int, int] = {}
        for proc in procs:
            pid, amount = int(proc.pid), int(proc.usedGpuMemory or 0)  # None: not available
            used[pid] = max(used.get(pid, 0), amount)
        return [ProcessMemory(pid, amount) for pid, amount in sorted(used.items())]

    def device_utilization(self, index: int) -> int:
        nvml, handle = self._nvml, self._handle(index)
        with self._call(index):
            return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        nvml, handle = self._nvml, self._handle(index)
        with self._call(index):
            try:
                _kind, raw = nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, since_us)
            except nvml.NVMLError as err:
                code = int(err.value)
                if code in (int(nvml.NVML_ERROR_NOT_FOUND), int(nvml.NVML_SUCCESS)):
                    return []  # nothing newer than since_us
                if code in (int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)):
                    raise DeviceSamplesUnsupportedError(f"GPU {index}: nvmlDeviceGetSamples: {err}") from err
                raise
        # NVML_VALUE_TYPE_UNSIGNED_INT for utilization samples: the union's uiVal.
        samples = {int(s.timeStamp): int(s.sampleValue.uiVal) for s in raw if int(s.timeStamp) > since_us}
        return [DeviceSample(stamp, min(100, util)) for stamp, util in sorted(samples.items())]

    def sample_period_s(self, index: int) -> float | None:
        """The driver's sample period: the median gap between the device's utilization
        samples (``nvmlDeviceGetSamples``), taken every period whether the GPU is busy or not.
        None when the driver does not say (then the estimator learns it from the samples)."""
        nvml, handle = self._nvml, self._handle(index)
        try:
            with self._call(index):
                _kind, samples = nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        except NvmlError as err:
            log.info(
                "GPU %d: no device utilization samples (%s): sample period learned from samples", index, err
            )
            return None
        stamps = sorted({int(s.timeStamp) for s in samples})
        gaps = sorted(b - a for a, b in itertools.pairwise(stamps) if b > a)
        if not gaps:
            return None
        return gaps[len(gaps) // 2] / 1_000_000

    # --- MIG ----------------------------------------------------------------------------

    def mig(self, index: int) -> MigInfo:
        """MIG mode and devices (``nvml_mig``), read-only."""
        handle = self._handle(index)
        if self._mig_minors is None:
            try:
                self._mig_minors = read_minors(self._mig_minors_path)
            except PlatformError as err:
                log.warning("%s; MIG capability minors numbered by the driver's fixed rule", err)
                self._mig_minors = {}
        with self._call(index):
            return read_mig(self._nvml, handle, index, self._gpus[index].minor, self._mig_minors)

    def mig_control(self) -> MigControl:
        """MIG mode and instance changes (``migcontrol``) through this backend's handles and errors."""
        return MigControl(self._nvml, self._handle, self._call, pynvml_placement(self._nvml))

    # --- driver-native limits -----------------------------------------------------------

    def mps_control_command(self) -> list[str]:
        return ["nvidia-cuda-mps-control", "-f"]

    def memory_limits_support(self) -> str | None:
        return limits_support(self._nvml)

    def set_memory_limit(self, index: int, cgroup: Path, limit_bytes: int | None) -> None:
        handle = self._handle(index)
        try:
            with self._call(index):
                set_cgroup_limit(self._nvml, handle, cgroup, limit_bytes)
        except NvmlError as err:
            raise MemoryLimitUnsupportedError(f"GPU {index}: cannot limit memory of {cgroup}: {err}") from err

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        # An in-flight nvmlEventSetWait ends by its timeout; freeing the set under it is unsafe.
        with self._wait_lock:
            if self._event_set is not None:
                self._free_event_set(self._event_set)
                self._event_set = None
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as err:
                log.warning("nvmlShutdown failed: %s", err)


def open_nvml_backend(
    nvml: ModuleType | None = None, sysfs_root: Path = Path("/sys"), driver_root: Path | None = None
) -> NvmlBackend:
    """Initialize NVML and read the inventory. ``nvml`` defaults to ``pynvml``, imported here.
    When the library is not found by name, ``driver_root`` (this process's view of the
    driver's files) is searched for it."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as err:
            raise NvmlError(
                _LIBRARY_NOT_FOUND,
                "the NVML Python binding (nvidia-ml-py) is not installed; install it, or run "
                "the agent with --simulate on a node without GPUs",
            ) from err
    try:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            missing = int(err.value) == int(nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
            if not (missing and driver_root is not None and load_from_driver_root(nvml, driver_root)):
                raise
            nvml.nvmlInit()
    except nvml.NVMLError as err:
        code = int(err.value)
        raise NvmlError(code, f"{err}: {init_hint(nvml, code)}") from err
    try:
        return NvmlBackend(nvml, sysfs_root)
    except BaseException:
        try:
            nvml.nvmlShutdown()  # undo nvmlInit; the original error is the one to report
        except nvml.NVMLError as err:
            log.warning("nvmlShutdown after a failed start failed: %s", err)
        raise
