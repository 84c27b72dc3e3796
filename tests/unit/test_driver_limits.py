"""Per-cgroup GPU memory limits by the driver: NVML's probe and call (fake NVML), and the
controller that sets them for every quota'd container."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.control.driverlimits import DriverMemoryLimits
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.errors import MemoryLimitUnsupportedError
from agent.platform.gpu.nvml import NvmlBackend, open_nvml_backend
from agent.platform.gpu.nvml_limits import NO_LIMIT
from tests.fakes.fake_nvml import FakeGpu, FakeNvml

MIB = 1 << 20
CGROUP = Path("/sys/fs/cgroup/kubepods/burstable/pod1/abc")


def one_gpu(**options: object) -> FakeNvml:
    return FakeNvml([FakeGpu("GPU-0000aaaa-0000-0000-0000-000000000000", "00000000:07:00.0", 0)], **options)  # type: ignore[arg-type]


@pytest.fixture
def backend(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[NvmlBackend, FakeNvml]]:
    fake = one_gpu(**getattr(request, "param", {}))
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    yield backend, fake
    backend.close()


def test_a_driver_with_the_call_limits_a_cgroup_and_clears_it(backend: tuple[NvmlBackend, FakeNvml]) -> None:
    nvml, fake = backend
    assert nvml.memory_limits_support() is None
    nvml.set_memory_limit(0, CGROUP, 2048 * MIB)
    assert fake.memory_limits[0][str(CGROUP)] == (2048 * MIB, 2048 * MIB)
    nvml.set_memory_limit(0, CGROUP, None)
    assert fake.memory_limits[0][str(CGROUP)] == (0, NO_LIMIT)  # NVML's way to clear


@pytest.mark.parametrize("backend", [{"driver_lacks": ["nvmlDeviceSetMemoryLimits_v1"]}], indirect=True)
def test_an_older_driver_is_found_out_by_the_probe(backend: tuple[NvmlBackend, FakeNvml]) -> None:
    nvml, _fake = backend
    reason = nvml.memory_limits_support()
    assert reason is not None and "R615" in reason
    with pytest.raises(MemoryLimitUnsupportedError, match="cannot limit memory"):
        nvml.set_memory_limit(0, CGROUP, 2048 * MIB)


@pytest.mark.parametrize("backend", [{"missing": ["nvmlDeviceSetMemoryLimits_v1"]}], indirect=True)
def test_an_older_binding_is_found_out_by_the_probe(backend: tuple[NvmlBackend, FakeNvml]) -> None:
    reason = backend[0].memory_limits_support()
    assert reason is not None and "nvidia-ml-py" in reason


def spec(label: str, quota: int | None, container_id: str = "abc") -> EnforcementSpec:
    return EnforcementSpec(
        pod_uid=f"uid-{label}",
        namespace="default",
        pod=label,
        container="c",
        container_id=container_id,
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=30,
        cap=30,
        memory_quota_mib=quota,
        policy=Policy.FIXED_SHARE,
    )


def test_each_quota_is_set_once_and_again_when_it_changes(backend: tuple[NvmlBackend, FakeNvml]) -> None:
    nvml, fake = backend
    limits = DriverMemoryLimits(nvml, lambda s: CGROUP / s.pod, unavailable=nvml.memory_limits_support())
    limits.apply([spec("a", 1024), spec("b", None), spec("c", 512, container_id="")])
    assert fake.memory_limits[0] == {
        str(CGROUP / "a"): (1024 * MIB, 1024 * MIB)
    }  # b: no quota, c: not started
    limits.apply([spec("a", 1024)])
    assert fake.call_counts["nvmlDeviceSetMemoryLimits_v1"] == 1
    limits.apply([spec("a", 2048)])
    assert fake.memory_limits[0][str(CGROUP / "a")] == (2048 * MIB, 2048 * MIB)
    assert limits.holder("default/a/c") == (True, f"driver limit 2048 MiB on {CGROUP / 'a'}")
    assert limits.holder("default/b/c") == (False, "not set yet")


def test_a_failed_call_leaves_the_quota_to_the_guard_and_says_why(
    backend: tuple[NvmlBackend, FakeNvml], caplog: pytest.LogCaptureFixture
) -> None:
    nvml, fake = backend
    fake.fail_call("nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_NO_PERMISSION)
    limits = DriverMemoryLimits(nvml, lambda s: CGROUP, unavailable=None)
    with caplog.at_level(logging.WARNING):
        limits.apply([spec("a", 1024)])
        limits.apply([spec("a", 1024)])  # not retried in a loop
    held, why = limits.holder("default/a/c")
    assert not held and "cannot limit memory" in why
    assert caplog.text.count("held by the memory guard") == 1
    assert fake.memory_limits == {}


def test_a_node_without_driver_limits_never_calls() -> None:
    fake = one_gpu(driver_lacks=["nvmlDeviceSetMemoryLimits_v1"])
    nvml = open_nvml_backend(fake, sysfs_root=Path("/nonexistent"))
    try:
        limits = DriverMemoryLimits(nvml, lambda s: CGROUP, unavailable="driver memory limits need cgroup v2")
        limits.apply([spec("a", 1024)])
        assert fake.call_counts["nvmlDeviceSetMemoryLimits_v1"] == 0
        assert limits.holder("default/a/c") == (False, "driver memory limits need cgroup v2")
    finally:
        nvml.close()
