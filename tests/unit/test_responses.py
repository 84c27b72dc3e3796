"""Allocate's ContainerAllocateResponse for each device-list strategy."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.domain.requests import ResolvedRequest
from agent.platform.driverfiles import DriverFiles, DriverMount
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder

GPUS = tuple(
    GpuInfo(
        index=i,
        uuid=f"GPU-{i}{i}{i}{i}aaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        model="NVIDIA H100 80GB HBM3",
        memory_mib=81920,
        minor=minor,
        pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
        numa_node=0,
    )
    for i, minor in enumerate([0, 3, 5])
)
DRIVER = DriverFiles(
    libraries=(
        DriverMount("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/host/usr/lib/libcuda.so.550.54.15"),
        DriverMount("/usr/lib64/libcuda.so.1", "/host/usr/lib/libcuda.so.550.54.15"),
        DriverMount("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/host/usr/lib/libnvidia-ml.so.550.54.15"),
    ),
    binaries=(DriverMount("/usr/bin/nvidia-smi", "/host/usr/bin/nvidia-smi"),),
)
CONTROL = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def build(
    strategy: DeviceListStrategy, request: ResolvedRequest, dev_root: str = "/host"
) -> pb.ContainerAllocateResponse:
    return ResponseBuilder(strategy, DRIVER, Path(dev_root)).build(request)


SHARE = ResolvedRequest(30, (GPUS[1],))
TWO = ResolvedRequest(200, (GPUS[0], GPUS[2]))


def test_mounts_strategy_share_of_one_gpu() -> None:
    response = build(DeviceListStrategy.MOUNTS, SHARE)
    devices = [(d.container_path, d.host_path, d.permissions) for d in response.devices]
    assert devices == [
        ("/dev/nvidiactl", "/host/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/host/dev/nvidia-uvm", "rw"),
        ("/dev/nvidia-uvm-tools", "/host/dev/nvidia-uvm-tools", "rw"),
        ("/dev/nvidia3", "/host/dev/nvidia3", "rw"),
    ]
    mounts = [(m.container_path, m.host_path, m.read_only) for m in response.mounts]
    assert mounts == [(m.container_path, m.host_path, True) for m in DRIVER.mounts]
    envs = dict(response.envs)
    # The image's own search paths stay: the files are where they already look.
    assert "LD_LIBRARY_PATH" not in envs
    assert "PATH" not in envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPUS[1].uuid
    assert envs["VCUDA_CORE"] == "30"
    assert envs["VCUDA_GPU_UUIDS"] == GPUS[1].uuid
    assert list(response.cdi_devices) == []


def test_mounts_strategy_two_gpus_gets_both_device_nodes() -> None:
    response = build(DeviceListStrategy.MOUNTS, TWO)
    paths = [d.container_path for d in response.devices]
    assert paths == [*CONTROL, "/dev/nvidia0", "/dev/nvidia5"]
    assert all(d.permissions == "rw" for d in response.devices)
    uuids = f"{GPUS[0].uuid},{GPUS[2].uuid}"
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == uuids
    assert response.envs["VCUDA_GPU_UUIDS"] == uuids
    assert response.envs["VCUDA_CORE"] == "200"


@pytest.mark.parametrize(("dev_root", "prefix"), [("/", ""), ("/run/nvidia/driver", "/run/nvidia/driver")])
def test_device_host_paths_are_under_dev_root(dev_root: str, prefix: str) -> None:
    response = build(DeviceListStrategy.MOUNTS, SHARE, dev_root)
    assert [d.host_path for d in response.devices] == [f"{prefix}{p}" for p in [*CONTROL, "/dev/nvidia3"]]


def test_envvar_strategy_has_no_mounts() -> None:
    response = build(DeviceListStrategy.ENVVAR, TWO)
    assert list(response.mounts) == []
    assert [d.container_path for d in response.devices] == [*CONTROL, "/dev/nvidia0", "/dev/nvidia5"]
    envs = dict(response.envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{GPUS[0].uuid},{GPUS[2].uuid}"
    assert envs["VCUDA_CORE"] == "200"
    assert "LD_LIBRARY_PATH" not in envs
    assert "PATH" not in envs


def test_cdi_strategy_names_cdi_devices_only() -> None:
    response = build(DeviceListStrategy.CDI, TWO)
    assert [c.name for c in response.cdi_devices] == [
        f"nvidia.com/gpu={GPUS[0].uuid}",
        f"nvidia.com/gpu={GPUS[2].uuid}",
    ]
    assert list(response.devices) == []
    assert list(response.mounts) == []
    envs = dict(response.envs)
    assert envs["VCUDA_CORE"] == "200"
    assert envs["VCUDA_GPU_UUIDS"] == f"{GPUS[0].uuid},{GPUS[2].uuid}"
    assert "LD_LIBRARY_PATH" not in envs


def test_mounts_strategy_without_driver_files_still_gives_devices() -> None:
    response = ResponseBuilder(DeviceListStrategy.MOUNTS, DriverFiles()).build(SHARE)
    assert list(response.mounts) == []
    assert [d.host_path for d in response.devices] == [*CONTROL, "/dev/nvidia3"]
