"""What a GPU backend reports: devices, topology, events and per-process samples.

Both backends (NVML and simulated) implement ``GpuBackend``; nothing above the
platform layer knows which one it talks to.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.platform.gpu.migcontrol import MigControl
from agent.platform.gpu.migstate import MigInfo


class TopologyLevel(enum.IntEnum):
    """How close two GPUs sit on PCIe; a larger value is closer.

    Mirrors NVML's ``nvmlGpuTopologyLevel_t`` in reverse order so that
    comparisons read naturally (``a > b`` means ``a`` is the better link).
    """

    SYSTEM = 0  # across CPU sockets (SMP interconnect)
    NODE = 1  # same NUMA node, different host bridges
    HOSTBRIDGE = 2  # same PCIe host bridge
    MULTIPLE_SWITCH = 3  # several PCIe switches apart
    SINGLE_SWITCH = 4  # behind one PCIe switch
    BOARD = 5  # same board (multi-GPU card)


@dataclass(frozen=True)
class Link:
    """The connection between two GPUs: PCIe closeness plus NVLink count."""

    level: TopologyLevel
    nvlinks: int = 0

    def rank(self) -> tuple[int, int]:
        """Sort key: any NVLink beats any PCIe path; then more links, then closer PCIe."""
        return (self.nvlinks, int(self.level))


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one physical GPU."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    minor: int  # /dev/nvidia<minor>
    pci_bus_id: str
    numa_node: int | None  # None when the platform does not say

    @property
    def device_path(self) -> str:
        return f"/dev/nvidia{self.minor}"


@dataclass(frozen=True)
class Topology:
    """Pairwise links; keys are ``(i, j)`` GPU indexes with ``i < j``."""

    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)

    def link(self, a: int, b: int) -> Link:
        if a == b:
            raise ValueError("a GPU has no link to itself")
        key = (a, b) if a < b else (b, a)
        return self.links.get(key, Link(TopologyLevel.SYSTEM))


class EventKind(enum.Enum):
    XID = "xid"  # the driver reported an XID error
    LOST = "lost"  # the GPU fell off the bus / needs a reset
    RECOVERED = "recovered"  # the GPU was reset and answers again (simulator, operator)


@dataclass(frozen=True)
class DeviceEvent:
    """A raw health event from the backend; ``HealthPolicy`` decides what it means."""

    gpu_index: int
    kind: EventKind
    xid: int | None = None
    detail: str = ""
    gpu_instance: int | None = None  # the MIG GPU instance the XID is attributed to (None: the GPU)


@dataclass(frozen=True)
class ProcessSample:
    """One per-process utilization sample, as NVML reports them.

    ``timestamp_us`` is the CPU timestamp in microseconds (wall clock) at which
    the sample window ended; samples can arrive seconds late.
    """

    pid: int
    timestamp_us: int
    sm_util: int  # percent of the GPU's SMs, 0..100
    mem_util: int = 0  # percent of memory bandwidth


@dataclass(frozen=True)
class DeviceSample:
    """One device utilization sample (``nvmlDeviceGetSamples`` with
    ``NVML_GPU_UTILIZATION_SAMPLES``): the percent of its sample period during which one or
    more kernels executed, stamped with the period's end (wall clock, µs). Taken every
    period whether the GPU is busy or not, so it is the one per-period record of how busy the
    GPU was (per-process samples credit whoever happened to be resident: docs/reference.md,
    "The driver's samples")."""

    timestamp_us: int
    util: int  # percent of the period, 0..100


@dataclass(frozen=True)
class ProcessMemory:
    """GPU memory a process holds on one GPU."""

    pid: int
    used_bytes: int


# The NVML function behind each per-GPU call of a backend: what a degraded GPU's reason
# names (``guarded.py``), and what the simulator's hang knob takes (``sim-event --hang``).
CALL_PROCESS_SAMPLES = "nvmlDeviceGetProcessUtilization"
CALL_DEVICE_UTILIZATION = "nvmlDeviceGetUtilizationRates"
CALL_PROCESS_MEMORY = "nvmlDeviceGetComputeRunningProcesses"
CALL_SAMPLE_PERIOD = "nvmlDeviceGetSamples"
CALL_DEVICE_SAMPLES = "nvmlDeviceGetSamples"  # the same function, read for its values
CALL_SET_MEMORY_LIMIT = "nvmlDeviceSetMemoryLimits_v1"
CALL_MIG = "nvmlDeviceGetMigMode"  # and the MIG device reads after it (backend.mig)
PER_GPU_CALLS = (
    CALL_PROCESS_SAMPLES,
    CALL_DEVICE_UTILIZATION,
    CALL_PROCESS_MEMORY,
    CALL_SAMPLE_PERIOD,
    CALL_SET_MEMORY_LIMIT,
)


class GpuBackend(Protocol):
    """The one interface the agent uses to learn about GPUs."""

    @property
    def name(self) -> str:
        """``"nvml"`` or ``"simulated"``."""
        ...

    def gpus(self) -> Sequence[GpuInfo]:
        """All GPUs, ordered by index."""
        ...

    def topology(self) -> Topology:
        """Pairwise links between GPUs."""
        ...

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        """Block up to ``timeout_s`` for health events; ``[]`` on timeout."""
        ...

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        """Per-process samples newer than ``since_us``; ``[]`` when none are new."""
        ...

    def process_memory(self, index: int) -> list[ProcessMemory]:
        """Processes holding memory on the GPU now."""
        ...

    def device_utilization(self, index: int) -> int:
        """Current SM utilization of the whole GPU, in percent."""
        ...

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        """Device utilization samples newer than ``since_us``, in time order; ``[]`` when none
        are new."""
        ...

    def sample_period_s(self, index: int) -> float | None:
        """The driver's per-process sample period, seconds (None: unknown)."""
        ...

    def mig(self, index: int) -> MigInfo:
        """The GPU's MIG mode (current and pending) and MIG devices, read-only; a GPU without
        MIG reports ``capable=False``."""
        ...

    def mig_control(self) -> MigControl:
        """MIG mode and instance changes on the GPUs (``migcontrol``); errors are
        ``MigChangeError``."""
        ...

    def mps_control_command(self) -> list[str]:
        """The MPS control daemon command for one GPU, run in the foreground."""
        ...

    def memory_limits_support(self) -> str | None:
        """Why per-cgroup GPU memory limits cannot be set here (None: they can)."""
        ...

    def set_memory_limit(self, index: int, cgroup: Path, limit_bytes: int | None) -> None:
        """The driver's hard GPU memory limit for a cgroup (v2 directory, full path) and its
        descendants; None clears it. ``MemoryLimitUnsupportedError`` when it cannot."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown, watchers stopped)."""
        ...
