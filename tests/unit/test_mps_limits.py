"""MPS limits as the hardware applies them, and as Allocate hands them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.control.mpsgrants import MpsGrant
from agent.domain.requests import ResolvedRequest
from agent.errors import InvalidSpecError
from agent.platform.driverfiles import DriverFiles
from agent.platform.gpu.mpspartition import (
    curve_throughput,
    effective_share,
    granted_sms,
    partition_for,
    sm_count_for,
    throughput_curve_for,
)
from agent.platform.gpu.sim.workload import mps_memory_limit_mib
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from tests.unit.test_responses import GPUS


def test_a_percentage_is_rounded_down_to_whole_tpcs() -> None:
    assert granted_sms(30, 132) == 38  # 39.6 SMs: 19 TPCs
    assert granted_sms(0.5, 132) == 2  # at least one TPC
    assert granted_sms(100, 132) == 132
    assert effective_share(50, 132) == 0.5
    assert effective_share(30, None) == pytest.approx(0.3)  # unknown SM count: as given


@pytest.mark.parametrize("cap", range(1, 101))
def test_the_percentage_handed_out_gives_the_most_tpcs_within_the_cap(cap: int) -> None:
    part = partition_for(cap, 132)
    assert part.sms == granted_sms(part.percent, 132)
    share = 100 * part.sms / 132
    assert part.effective_percent == pytest.approx(share, abs=0.005)
    assert share <= max(cap, 100 * 2 / 132) + 1e-9  # a ceiling (one TPC at least)
    assert cap - share < 100 * 2 / 132  # less than one TPC below it
    assert part.percent <= max(cap, 2)
    assert part.percent == 1 or granted_sms(part.percent - 1, 132) < part.sms  # the smallest such


def test_sm_counts_go_by_product_name() -> None:
    assert sm_count_for("NVIDIA H100 80GB HBM3") == 132
    assert sm_count_for("NVIDIA H100 PCIe") == 114
    assert sm_count_for("NVIDIA A100-SXM4-40GB") == 108
    assert sm_count_for("Some Future GPU") is None
    assert partition_for(30, None).percent == 30


def test_allocate_of_an_mps_share_sets_its_limits_and_mounts_its_pipes() -> None:
    grant = MpsGrant(1, partition_for(30, 132), 2048, Path("/run/m/GPU-1/pipe"), Path("/run/m/GPU-1/log"))
    builder = ResponseBuilder(DeviceListStrategy.ENVVAR, DriverFiles(libraries=(), binaries=()), Path("/"))
    response = builder.build(ResolvedRequest(30, (GPUS[1],)), grant)
    envs = dict(response.envs)
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "29"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/vcuda-mps/pipe"
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPUS[1].uuid
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    assert mounts["/run/vcuda-mps/pipe"] == ("/run/m/GPU-1/pipe", True)  # a tenant must not write there
    assert mounts["/run/vcuda-mps/log"] == ("/run/m/GPU-1/log", True)
    plain = builder.build(ResolvedRequest(30, (GPUS[1],)))
    assert not any(k.startswith("CUDA_MPS") for k in plain.envs)  # freezer: no MPS at all
    assert not plain.mounts


def test_a_client_reads_its_pinned_memory_limit_for_device_0() -> None:
    assert mps_memory_limit_mib({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}) == 2048
    assert mps_memory_limit_mib({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=1G,0=2G"}) == 2048
    assert mps_memory_limit_mib({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=1G"}) is None
    assert mps_memory_limit_mib({}) is None
    with pytest.raises(InvalidSpecError, match="not a size"):
        mps_memory_limit_mib({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=lots"})


@pytest.mark.parametrize("cap", [5, 10, 20, 25, 30, 40, 50, 60, 75, 90, 100])
def test_on_a_recorded_curve_a_cap_is_a_share_of_throughput(cap: int) -> None:
    curve = throughput_curve_for("NVIDIA H200")
    assert curve is not None and throughput_curve_for("NVIDIA H100 80GB HBM3") is None
    part = partition_for(cap, 132, curve)
    assert cap - 3 <= part.effective_percent <= cap  # delivered within [cap - 3, cap]
    assert curve_throughput(part.percent + 1, curve) > cap / 100 or part.percent == 100  # the most


def test_the_recorded_points_are_what_the_h200_gave() -> None:
    curve = throughput_curve_for("NVIDIA H200")
    assert curve is not None
    assert curve_throughput(30, curve) == pytest.approx(0.248)  # what a cap of 30 got before
    assert curve_throughput(61, curve) < curve_throughput(60, curve)  # not monotonic
    assert partition_for(30, 132, curve).percent == 35
