"""Device IDs: ``<GPU UUID>-vcore-NN``, 100 per GPU, at most 63 characters."""

from __future__ import annotations

import pytest

from agent.domain.ids import MAX_ID_LENGTH, UNITS_PER_GPU, CoreUnit, decode, encode, ids_for_gpu
from agent.errors import DeviceIdError

UUIDS = [
    "GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab",
    "GPU-00000000-0000-0000-0000-000000000000",
    "GPU-FFFFFFFF-ABCD-ef01-2345-6789ABCDEF01",
]


@pytest.mark.parametrize("uuid", UUIDS)
@pytest.mark.parametrize("unit", [0, 1, 7, 10, 42, 99])
def test_encode_decode_round_trip(uuid: str, unit: int) -> None:
    device_id = encode(uuid, unit)
    assert device_id == f"{uuid}-vcore-{unit:02d}"
    assert decode(device_id) == CoreUnit(uuid, unit)


@pytest.mark.parametrize("uuid", UUIDS)
def test_ids_for_gpu_are_100_distinct_short_ids(uuid: str) -> None:
    ids = ids_for_gpu(uuid)
    assert len(ids) == UNITS_PER_GPU == 100
    assert len(set(ids)) == 100
    assert all(len(i) <= MAX_ID_LENGTH == 63 for i in ids)
    assert [decode(i) for i in ids] == [CoreUnit(uuid, u) for u in range(100)]


def test_ids_of_different_gpus_do_not_collide() -> None:
    all_ids = [i for uuid in UUIDS for i in ids_for_gpu(uuid)]
    assert len(set(all_ids)) == len(UUIDS) * 100


@pytest.mark.parametrize(
    "device_id",
    [
        pytest.param("GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab-07", id="no-separator"),
        pytest.param("GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab-vcore-100", id="unit-100"),
        pytest.param("GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab-vcore-007", id="three-digits"),
        pytest.param("GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab-vcore-7", id="one-digit"),
        pytest.param("GPU-6b1c9f3e-2a4d-4e8b-9c7f-0123456789ab-vcore-xx", id="non-digit-unit"),
        pytest.param("", id="empty"),
        pytest.param("-vcore-07", id="empty-uuid"),
        pytest.param("GPU 6b1c9f3e-vcore-07", id="space-in-uuid"),
        pytest.param(" GPU-6b1c9f3e-vcore-07", id="leading-space"),
        pytest.param("GPU-6b1c9f3e-vcore-07 ", id="trailing-space"),
        pytest.param("GPU-6b1c9f3e-vcore-07\n", id="trailing-newline"),
    ],
)
def test_decode_rejects_malformed_ids(device_id: str) -> None:
    with pytest.raises(DeviceIdError, match="not a vcuda-core device ID"):
        decode(device_id)


@pytest.mark.parametrize("unit", [-1, 100, 1000])
def test_encode_rejects_unit_out_of_range(unit: int) -> None:
    with pytest.raises(DeviceIdError, match=r"outside 0\.\.99"):
        encode(UUIDS[0], unit)


def test_encode_accepts_the_longest_uuid_that_fits() -> None:
    uuid = "GPU-" + "a" * (MAX_ID_LENGTH - len("GPU-") - len("-vcore-00"))
    device_id = encode(uuid, 99)
    assert len(device_id) == MAX_ID_LENGTH
    assert decode(device_id) == CoreUnit(uuid, 99)


def test_encode_rejects_too_long_uuid() -> None:
    uuid = "GPU-" + "a" * (MAX_ID_LENGTH - len("GPU-") - len("-vcore-00") + 1)
    with pytest.raises(DeviceIdError, match="at most 63"):
        encode(uuid, 0)


@pytest.mark.parametrize("uuid", ["", "GPU 1234", "GPU-12/34", "-GPU-1234", "GPU-ü"])
def test_encode_rejects_uuids_that_cannot_form_an_id(uuid: str) -> None:
    with pytest.raises(DeviceIdError):
        encode(uuid, 0)
