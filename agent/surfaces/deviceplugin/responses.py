"""Building Allocate's ContainerAllocateResponse for each device-list strategy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.domain.requests import ResolvedRequest
from agent.platform.driverfiles import CONTAINER_ROOT, DriverFiles
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy

CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CDI_KIND = "nvidia.com/gpu"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ResponseBuilder:
    strategy: DeviceListStrategy
    driver: DriverFiles
    dev_root: Path = Path("/")  # host path under which /dev/nvidia* live

    def build(self, request: ResolvedRequest) -> pb.ContainerAllocateResponse:
        uuids = ",".join(g.uuid for g in request.gpus)
        envs = {"VCUDA_CORE": str(request.cores), "VCUDA_GPU_UUIDS": uuids}
        response = pb.ContainerAllocateResponse()
        if self.strategy is DeviceListStrategy.CDI:
            response.cdi_devices.extend(pb.CDIDevice(name=f"{CDI_KIND}={g.uuid}") for g in request.gpus)
        else:
            response.devices.extend(self._device_specs(request))
            # Also narrows the NVIDIA runtime, if installed, from an image's "all" to these GPUs.
            envs["NVIDIA_VISIBLE_DEVICES"] = uuids
        if self.strategy is DeviceListStrategy.MOUNTS:
            response.mounts.extend(
                pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=True)
                for m in self.driver.mounts
            )
            envs["LD_LIBRARY_PATH"] = f"{CONTAINER_ROOT}/lib64"
            envs["PATH"] = f"{CONTAINER_ROOT}/bin:{_DEFAULT_PATH}"
        response.envs.update(envs)
        return response

    def _device_specs(self, request: ResolvedRequest) -> list[pb.DeviceSpec]:
        paths = [*CONTROL_DEVICES, *(g.device_path for g in request.gpus)]
        return [
            pb.DeviceSpec(container_path=p, host_path=str(self.dev_root / p.lstrip("/")), permissions="rw")
            for p in paths
        ]
