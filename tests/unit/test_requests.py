"""The vcuda-core request rule and the meaning of a set of device IDs."""

from __future__ import annotations

import pytest

from agent.domain.ids import encode, ids_for_gpu
from agent.domain.requests import ResolvedRequest, check_core_request, is_whole, resolve_ids
from agent.errors import AllocationError, DeviceIdError
from agent.platform.gpu.inventory import GpuInfo

UUIDS = (
    "GPU-11111111-2222-3333-4444-555555555550",
    "GPU-11111111-2222-3333-4444-555555555551",
    "GPU-11111111-2222-3333-4444-555555555552",
)
GPUS = tuple(
    GpuInfo(
        index=i,
        uuid=u,
        model="NVIDIA H100 80GB HBM3",
        memory_mib=81920,
        minor=i,
        pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
        numa_node=0,
    )
    for i, u in enumerate(UUIDS)
)


def units(gpu: int, count: int, first: int = 0) -> list[str]:
    return [encode(UUIDS[gpu], u) for u in range(first, first + count)]


@pytest.mark.parametrize("cores", [1, 50, 99, 100, 200, 800])
def test_valid_core_requests(cores: int) -> None:
    check_core_request(cores)  # must not raise
    assert is_whole(cores) == (cores >= 100)


@pytest.mark.parametrize("cores", [0, -1, 150, 250, 101, 199])
def test_invalid_core_requests_state_the_rule(cores: int) -> None:
    with pytest.raises(AllocationError) as info:
        check_core_request(cores)
    message = str(info.value)
    assert f"{cores} vcuda-core" in message
    assert "below 100" in message
    assert "multiple of 100" in message


def test_fractional_request_on_one_gpu() -> None:
    resolved = resolve_ids(GPUS, units(1, 30, first=40))
    assert resolved == ResolvedRequest(30, (GPUS[1],))
    assert not resolved.whole


def test_fractional_request_spanning_two_gpus_names_both() -> None:
    with pytest.raises(AllocationError) as info:
        resolve_ids(GPUS, units(0, 20) + units(2, 20))
    message = str(info.value)
    assert "GPUs 0 and 2" in message
    assert "below 100" in message
    assert not isinstance(info.value, DeviceIdError)


def test_two_whole_gpus() -> None:
    resolved = resolve_ids(GPUS, ids_for_gpu(UUIDS[2]) + ids_for_gpu(UUIDS[0]))
    assert resolved.cores == 200
    assert resolved.whole
    assert resolved.gpus == (GPUS[0], GPUS[2])  # ordered by index


def test_one_whole_gpu() -> None:
    resolved = resolve_ids(GPUS, ids_for_gpu(UUIDS[1]))
    assert resolved == ResolvedRequest(100, (GPUS[1],))


def test_200_as_100_plus_60_plus_40_is_rejected() -> None:
    ids = units(0, 100) + units(1, 60) + units(2, 40)
    assert len(ids) == 200
    with pytest.raises(AllocationError) as info:
        resolve_ids(GPUS, ids)
    message = str(info.value)
    assert "GPU 1 (60 units)" in message
    assert "GPU 2 (40 units)" in message
    assert "GPU 0" not in message


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(units(0, 100) + units(1, 50), id="150"),
        pytest.param(units(0, 100) + units(1, 100) + units(2, 50), id="250"),
    ],
)
def test_invalid_count_is_rejected(ids: list[str]) -> None:
    with pytest.raises(AllocationError, match="multiple of 100"):
        resolve_ids(GPUS, ids)


def test_duplicate_ids_are_rejected() -> None:
    ids = [*units(0, 10), encode(UUIDS[0], 3)]
    with pytest.raises(AllocationError, match="more than once"):
        resolve_ids(GPUS, ids)


def test_unknown_gpu_uuid_is_a_device_id_error() -> None:
    stranger = "GPU-99999999-2222-3333-4444-555555555555"
    with pytest.raises(DeviceIdError, match=stranger):
        resolve_ids(GPUS, [encode(stranger, 0)])


def test_malformed_id_is_a_device_id_error() -> None:
    with pytest.raises(DeviceIdError):
        resolve_ids(GPUS, ["not-an-id"])


def test_empty_request_is_rejected() -> None:
    with pytest.raises(AllocationError, match="below 100"):
        resolve_ids(GPUS, [])
