"""NVML's MIG write calls behind the backend (agent/platform/gpu/migcontrol.py) on the NVML
backend with the fake pynvml: the mode pending until a reset, instances created at their
placement with their compute instance, destroyed, and refusals raised as MigChangeError
from the agent's NvmlError, itself from pynvml's NVMLError."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.errors import MigChangeError, NvmlError
from agent.platform.gpu.migprofiles import Placement, full_ci_profile, product
from agent.platform.gpu.nvml import NvmlBackend, open_nvml_backend
from tests.fakes.fake_nvml import FakeGpu
from tests.fakes.fake_nvml_mig import FakeMigNvml

H100 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


@pytest.fixture
def fake() -> FakeMigNvml:
    return FakeMigNvml(
        [FakeGpu(H100, "00000000:07:00.0", 0, name="NVIDIA H100 80GB HBM3")], mig={0: "H100-80GB"}
    )


@pytest.fixture
def backend(fake: FakeMigNvml, tmp_path: Path) -> Iterator[NvmlBackend]:
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    yield backend
    backend.close()


def test_mode_instances_and_their_removal(fake: FakeMigNvml, backend: NvmlBackend) -> None:
    control = backend.mig_control()
    assert control.set_mode(0, True) is True  # pending until the GPU is reset
    assert backend.mig(0).pending and not backend.mig(0).current
    fake.mig(0).reset(None)
    gpu = product("H100-80GB")
    assert gpu is not None
    three = gpu.by_name("3g.40gb")
    assert three is not None
    gi, ci = control.create(0, three, Placement(0, 4), full_ci_profile(three, gpu))
    (device,) = backend.mig(0).devices
    assert (device.gi, device.ci, device.profile, device.placement_start) == (gi, ci, "3g.40gb", 0)
    control.destroy(0, gi, [ci])
    assert backend.mig(0).devices == ()


def test_refusals_are_mig_change_errors_from_nvml(fake: FakeMigNvml, backend: NvmlBackend) -> None:
    control = backend.mig_control()
    fake.mig_busy[0] = "2 processes use it"
    with pytest.raises(MigChangeError, match=r"GPU 0: the driver refused MIG mode on") as caught:
        control.set_mode(0, True)
    cause = caught.value.__cause__
    assert isinstance(cause, NvmlError) and cause.code == pynvml.NVML_ERROR_IN_USE
    assert isinstance(cause.__cause__, pynvml.NVMLError)
    del fake.mig_busy[0]
    control.set_mode(0, True)
    fake.mig(0).reset(None)
    gpu = product("H100-80GB")
    assert gpu is not None
    four, three = gpu.by_name("4g.40gb"), gpu.by_name("3g.40gb")
    assert four is not None and three is not None
    control.create(0, four, Placement(0, 4), full_ci_profile(four, gpu))
    with pytest.raises(MigChangeError, match=r"a 3g\.40gb GPU instance at 0:4") as taken:
        control.create(0, three, Placement(0, 4), full_ci_profile(three, gpu))
    assert isinstance(taken.value.__cause__, NvmlError)
    assert taken.value.__cause__.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert [d.profile for d in backend.mig(0).devices] == ["4g.40gb"]  # nothing half-made
