"""Building Allocate's ContainerAllocateResponse for each device-list strategy.

Its variables replace an image's variable of the same name (kubelet and the runtime apply
them over the image's environment; there is no appending), so it sets only variables that
an image has no reason to set (``VCUDA_*``, ``CUDA_MPS_*``) and NVIDIA_VISIBLE_DEVICES,
whose replacement is the point: an image's ``all`` must not reach the NVIDIA runtime.
Never PATH or LD_LIBRARY_PATH: driver files go where images already look
(agent/platform/driverfiles.py). The list and the reasons: README.md, "What a container gets".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.control.mpsgrants import MpsGrant
from agent.domain.migoffer import OfferedDevice
from agent.domain.requests import ResolvedRequest
from agent.platform.driverfiles import DriverFiles
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy, SharingSettings

CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CDI_KIND = "nvidia.com/gpu"


@dataclass(frozen=True)
class ResponseBuilder:
    strategy: DeviceListStrategy
    driver: DriverFiles
    dev_root: Path = Path("/")  # host path under which /dev/nvidia* live
    mps_pipe_dir: str = SharingSettings().container_pipe_dir  # where an MPS client sees its pipes
    mps_log_dir: str = SharingSettings().container_log_dir

    def build(self, request: ResolvedRequest, mps: MpsGrant | None = None) -> pb.ContainerAllocateResponse:
        uuids = ",".join(g.uuid for g in request.gpus)
        envs = {"VCUDA_CORE": str(request.cores), "VCUDA_GPU_UUIDS": uuids}
        response = pb.ContainerAllocateResponse()
        if self.strategy is DeviceListStrategy.CDI:
            response.cdi_devices.extend(pb.CDIDevice(name=f"{CDI_KIND}={g.uuid}") for g in request.gpus)
        else:
            response.devices.extend(self._device_specs(request))
            # Also narrows the NVIDIA runtime, if installed, from an image's "all" to these GPUs.
            envs["NVIDIA_VISIBLE_DEVICES"] = uuids
        response.mounts.extend(self._driver_mounts())
        if mps is not None:
            envs.update(self._mps_envs(mps))
            response.mounts.extend(
                [
                    # Read-only: a client only connects to the sockets there; a tenant must not
                    # replace them or plant a link where the daemon writes (docs/security.md).
                    pb.Mount(container_path=self.mps_pipe_dir, host_path=str(mps.pipe_dir), read_only=True),
                    pb.Mount(container_path=self.mps_log_dir, host_path=str(mps.log_dir), read_only=True),
                ]
            )
        response.envs.update(envs)
        return response

    def _mps_envs(self, mps: MpsGrant) -> dict[str, str]:
        """Read by the CUDA driver in the container at its first CUDA call; the pinned
        memory limit names device 0, the one GPU the container sees."""
        envs = {
            "CUDA_MPS_PIPE_DIRECTORY": self.mps_pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.mps_log_dir,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(mps.partition.percent),
            "VCUDA_SHARING": "mps",
        }
        if mps.memory_mib:
            envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mps.memory_mib}M"
        return envs

    def build_mig(self, devices: Sequence[OfferedDevice]) -> pb.ContainerAllocateResponse:
        """For whole MIG devices: their UUIDs (``MIG-...``) as CDI device names or in
        NVIDIA_VISIBLE_DEVICES, and the device nodes a process needs to use them: nvidiactl
        and UVM, the parent GPUs' ``/dev/nvidiaN``, and each device's GPU instance and
        compute instance capability nodes (``/dev/nvidia-caps/nvidia-cap<minor>``)."""
        uuids = ",".join(d.device.uuid for d in devices)
        envs = {"VCUDA_MIG_DEVICES": uuids}
        response = pb.ContainerAllocateResponse()
        if self.strategy is DeviceListStrategy.CDI:
            response.cdi_devices.extend(pb.CDIDevice(name=f"{CDI_KIND}={d.device.uuid}") for d in devices)
        else:
            parents = dict.fromkeys(d.gpu.device_path for d in devices)
            caps = [path for d in devices for path in d.device.cap_devices]
            response.devices.extend(self._specs([*CONTROL_DEVICES, *parents, *caps]))
            envs["NVIDIA_VISIBLE_DEVICES"] = uuids
        response.mounts.extend(self._driver_mounts())
        response.envs.update(envs)
        return response

    def _driver_mounts(self) -> list[pb.Mount]:
        if self.strategy is not DeviceListStrategy.MOUNTS:
            return []
        return [
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=True)
            for m in self.driver.mounts
        ]

    def _device_specs(self, request: ResolvedRequest) -> list[pb.DeviceSpec]:
        return self._specs([*CONTROL_DEVICES, *(g.device_path for g in request.gpus)])

    def _specs(self, paths: Sequence[str]) -> list[pb.DeviceSpec]:
        return [
            pb.DeviceSpec(container_path=p, host_path=str(self.dev_root / p.lstrip("/")), permissions="rw")
            for p in paths
        ]
