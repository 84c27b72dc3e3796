"""The project's own exception tree.

OS, NVML and gRPC errors are translated into these at the platform boundary
(``raise ... from err``) so upper layers handle one family of errors.
"""

from __future__ import annotations


class VcudaError(Exception):
    """Base class of every error the agent raises on purpose."""


class ConfigError(VcudaError):
    """Invalid settings or node config; ``problems`` lists every invalid field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if self.problems else "invalid configuration")


class MigGeometryError(ConfigError):
    """A MIG geometry of the node config that a GPU cannot take: a profile it does not have,
    or instances that do not fit its placements."""

    def __init__(self, message: str) -> None:
        super().__init__([message])


class GpuError(VcudaError):
    """A GPU backend (NVML or simulated) could not answer."""


class NvmlError(GpuError):
    """NVML returned an error code; ``code`` is the NVML_ERROR_* value."""

    def __init__(self, code: int, message: str, gpu_index: int | None = None) -> None:
        self.code = code
        self.gpu_index = gpu_index
        where = f"GPU {gpu_index}: " if gpu_index is not None else ""
        super().__init__(f"{where}NVML error {code}: {message}")


class GpuLostError(GpuError):
    """The GPU fell off the bus or needs a reset; it is unusable until then."""

    def __init__(self, gpu_index: int, detail: str) -> None:
        self.gpu_index = gpu_index
        super().__init__(f"GPU {gpu_index} is lost: {detail}")


class GpuHungError(GpuError):
    """A call on the GPU did not return within its deadline (the driver is stuck): the GPU
    is degraded until the call returns; ``call`` names the NVML function."""

    def __init__(self, gpu_index: int, call: str, detail: str) -> None:
        self.gpu_index = gpu_index
        self.call = call
        super().__init__(f"GPU {gpu_index}: {detail}")


class DeviceSamplesUnsupportedError(GpuError):
    """The driver keeps no device utilization samples (``nvmlDeviceGetSamples``) for this
    GPU: the compute-cap loop cannot attribute busy time from them there."""


class NoSuchGpuError(GpuError):
    """A GPU index or UUID that the inventory does not have."""


class SimulationError(GpuError):
    """The simulated GPU node is missing or its state is unusable."""


class InvalidSpecError(VcudaError):
    """A malformed ``--simulate`` spec or other user-supplied spec string."""


class AllocationError(VcudaError):
    """A device request breaks a rule (e.g. 150 vcuda-core) or cannot be placed."""


class WrongPodStartError(AllocationError):
    """PreStartContainer for IDs whose Allocate answer was built for another pod's container."""


class DeviceIdError(AllocationError):
    """A device ID that is malformed or names an unknown GPU."""


class InsufficientCapacityError(AllocationError):
    """A valid request that the free devices cannot satisfy."""


class GpuUnhealthyError(AllocationError):
    """A request for a GPU that is Unhealthy."""


class KubeletError(VcudaError):
    """Talking to kubelet (registration, sockets) failed."""


class ProcessGoneError(VcudaError):
    """A process exited, or its pid now belongs to another process."""


class PlatformError(VcudaError):
    """An OS facility (inotify, procfs, cgroupfs) failed."""


class KubeError(VcudaError):
    """The Kubernetes API refused or could not answer a request."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status  # HTTP status, None when the server was unreachable
        super().__init__(message)


class ConflictError(KubeError):
    """An optimistic-concurrency write lost (HTTP 409): re-read and try again."""


class PodFormatError(VcudaError):
    """A pod object from the API that lacks the fields the agent needs."""


class MpsUnavailableError(PlatformError):
    """An MPS control daemon cannot run here (binary missing, it will not start, its
    directories cannot be made, ...)."""


class MpsCommandError(PlatformError):
    """An MPS control command or signal did not get through: the program is missing or not
    permitted, it timed out or failed, or the daemon could not be signalled."""


class MigChangeError(GpuError):
    """A change of a GPU's MIG mode or instances that the agent would not make (processes on
    the GPU) or that the driver refused."""


class MemoryLimitUnsupportedError(GpuError):
    """The driver cannot limit GPU memory per cgroup (no nvmlDeviceSetMemoryLimits_v1, MIG,
    cgroup v1, ...)."""
