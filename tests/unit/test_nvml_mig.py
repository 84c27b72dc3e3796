"""NvmlBackend's MIG side against the fake NVML: modes, MIG devices, capability minors, NVML
errors translated at the boundary, and XIDs of a GPU instance; nothing is changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.errors import GpuLostError, NvmlError
from agent.platform.gpu.migprofiles import GI_PROFILE_COUNT, Placement, mig_minors
from agent.platform.gpu.migstate import MigDevice
from agent.platform.gpu.nvml import NvmlBackend, open_nvml_backend
from agent.platform.gpu.nvml_mig import read_minors
from agent.platform.gpu.nvmlcodes import NVML_INSTANCE_ID_ANY
from agent.platform.gpu.sim.mig import mig_uuid
from tests.fakes.fake_nvml import FakeGpu, FakeNvml
from tests.fakes.fake_nvml_mig import FakeMigNvml

H100 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
T4 = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


@pytest.fixture
def fake() -> FakeMigNvml:
    gpus = [
        FakeGpu(H100, "00000000:07:00.0", 0, name="NVIDIA H100 80GB HBM3"),
        FakeGpu(T4, "00000000:0F:00.0", 3, name="Tesla T4", memory_mib=15360),
    ]
    return FakeMigNvml(gpus, mig={0: "H100-80GB"})


@pytest.fixture
def backend(fake: FakeMigNvml, tmp_path: Path) -> Iterator[NvmlBackend]:
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    yield backend
    backend.close()


def enable(fake: FakeMigNvml, *profiles: tuple[int, Placement | None]) -> None:
    gpu = fake.mig(0)
    gpu.set_mode(1, None)
    gpu.reset(None)
    for profile_id, placement in profiles:
        gi = gpu.create_gi(profile_id, placement)
        gpu.create_ci(gi.id, {19: 0, 14: 1, 9: 2}[profile_id])


def test_numbering_matches_pynvml() -> None:
    assert GI_PROFILE_COUNT == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    assert pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 == 0x9
    assert pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE == 0x4
    assert NVML_INSTANCE_ID_ANY == pynvml.NVML_GPU_INSTANCE_ID_ANY


def test_a_gpu_without_mig_and_a_binding_without_mig_read_not_capable(
    backend: NvmlBackend, tmp_path: Path
) -> None:
    assert not backend.mig(1).capable  # the T4: NVML says NOT_SUPPORTED
    plain = open_nvml_backend(FakeNvml([FakeGpu(H100, "00000000:07:00.0", 0)]), sysfs_root=tmp_path)
    try:
        assert not plain.mig(0).capable  # no nvmlDeviceGetMigMode in the binding
    finally:
        plain.close()


def test_pending_mode_is_reported(backend: NvmlBackend, fake: FakeMigNvml) -> None:
    info = backend.mig(0)
    assert (info.capable, info.current, info.pending, info.devices) == (True, False, False, ())
    fake.mig(0).set_mode(1, None)
    info = backend.mig(0)
    assert (info.current, info.pending, info.change_pending) == (False, True, True)


def test_mig_devices_are_read_with_profiles_placements_and_minors(
    backend: NvmlBackend, fake: FakeMigNvml
) -> None:
    enable(fake, (9, Placement(0, 4)), (14, Placement(4, 2)), (19, Placement(6, 1)))
    info = backend.mig(0)
    assert (info.current, info.pending) == (True, True)
    assert info.devices == (
        MigDevice(0, 0, 1, 0, mig_uuid(H100, 1, 0), "3g.40gb", "3g.40gb", 9, 2, 0, 4, 40448, 60, 12, 13),
        MigDevice(0, 1, 5, 0, mig_uuid(H100, 5, 0), "2g.20gb", "2g.20gb", 14, 1, 4, 2, 20096, 32, 48, 49),
        MigDevice(0, 2, 13, 0, mig_uuid(H100, 13, 0), "1g.10gb", "1g.10gb", 19, 0, 6, 1, 9984, 16, 120, 121),
    )
    assert info.devices[0].cap_devices == ("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")


def test_minors_come_from_the_drivers_table_when_there_is_one(fake: FakeMigNvml, tmp_path: Path) -> None:
    table = tmp_path / "mig-minors"
    table.write_text(mig_minors([0]).replace("gpu0/gi1/access 12", "gpu0/gi1/access 500"))
    assert read_minors(table)["gpu0/gi1/access"] == 500
    assert read_minors(tmp_path / "absent") == {}
    enable(fake, (9, Placement(0, 4)))
    fake.nvmlInit()  # NvmlBackend takes over an initialized NVML
    backend = NvmlBackend(fake, tmp_path, mig_minors=table)
    try:
        device = backend.mig(0).devices[0]
        assert (device.gi, device.gi_cap_minor, device.ci_cap_minor) == (1, 500, 13)
    finally:
        backend.close()


def test_nvml_errors_are_translated(backend: NvmlBackend, fake: FakeMigNvml) -> None:
    enable(fake, (19, None))
    fake.fail_call("nvmlDeviceGetMigDeviceHandleByIndex", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlError) as caught:
        backend.mig(0)
    assert caught.value.code == pynvml.NVML_ERROR_NO_PERMISSION and caught.value.gpu_index == 0
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)
    fake.lose(0)
    with pytest.raises(GpuLostError):
        backend.mig(0)


def test_an_xid_of_a_gpu_instance_names_it(backend: NvmlBackend, fake: FakeMigNvml) -> None:
    enable(fake, (19, None))
    assert fake.inject_xid(0, 48, gpu_instance=13) == 1
    events = backend.wait_events(2.0)
    assert [(e.gpu_index, e.xid, e.gpu_instance) for e in events] == [(0, 48, 13)]
    assert "GPU instance 13" in events[0].detail
    fake.inject_xid(0, 79)
    assert [e.gpu_instance for e in backend.wait_events(2.0)] == [None]
