"""The simulated driver's MIG state (agent/platform/gpu/sim/mig.py): the mode pending until a
reset, instances on their placements, NVML's errors for each refusal, device UUIDs and
capability minors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.migprofiles import Placement, product
from agent.platform.gpu.nvmlcodes import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
)
from agent.platform.gpu.sim.mig import MigError, MigGpu, mig_uuid
from agent.platform.gpu.sim.workload import mig_from_environment
from agent.surfaces.cli.sim import mig_geometry

UUID = "GPU-11111111-2222-3333-4444-555555555555"


def h100(enabled: bool = True) -> MigGpu:
    gpu = MigGpu(0, 0, UUID, product("H100-80GB"))
    if enabled:
        gpu.set_mode(1, None)
        gpu.reset(None)
    return gpu


def code_of(fn: Callable[..., object], *args: object) -> int:
    with pytest.raises(MigError) as caught:
        fn(*args)
    return caught.value.code


def test_mode_change_stays_pending_until_a_reset() -> None:
    gpu = h100(enabled=False)
    assert (gpu.current, gpu.pending) == (False, False)
    assert gpu.set_mode(1, None) == NVML_ERROR_RESET_REQUIRED
    assert (gpu.current, gpu.pending) == (False, True)
    assert gpu.info().change_pending and not gpu.info().current
    assert code_of(gpu.create_gi, 19) == NVML_ERROR_NOT_SUPPORTED  # not in MIG mode yet
    gpu.reset(None)
    assert (gpu.current, gpu.pending) == (True, True)
    assert gpu.set_mode(1, None) == NVML_SUCCESS  # already the mode
    assert gpu.set_mode(0, None) == NVML_ERROR_RESET_REQUIRED
    assert (gpu.current, gpu.pending) == (True, False)
    gpu.reset(None)
    assert (gpu.current, gpu.pending) == (False, False)


def test_mode_changes_need_an_idle_gpu_and_no_instances() -> None:
    gpu = h100()
    assert code_of(gpu.set_mode, 0, "1 process(es) use it") == NVML_ERROR_IN_USE
    gpu.create_gi(19)
    assert code_of(gpu.set_mode, 0, None) == NVML_ERROR_IN_USE  # instances exist
    assert code_of(gpu.set_mode, 2, None) == NVML_ERROR_INVALID_ARGUMENT
    assert code_of(gpu.reset, "1 process(es) use it") == NVML_ERROR_IN_USE


def test_a_reset_destroys_every_instance() -> None:
    gpu = h100()
    gi = gpu.create_gi(9)
    ci = gpu.create_ci(gi.id, 2)
    assert gpu.reset(None) == [ci.uuid]
    assert gpu.gis == {} and gpu.info().devices == ()


def test_a_gpu_without_mig_is_not_supported_everywhere() -> None:
    t4 = MigGpu(1, 1, UUID, None)
    assert code_of(t4.set_mode, 1, None) == NVML_ERROR_NOT_SUPPORTED
    assert code_of(t4.profile, 0) == NVML_ERROR_NOT_SUPPORTED
    assert code_of(t4.create_gi, 19) == NVML_ERROR_NOT_SUPPORTED
    assert not t4.info().capable


def test_profiles_and_placements_by_nvml_numbers() -> None:
    gpu = h100(enabled=False)
    assert gpu.profile(3).name == "4g.40gb"  # NVML_GPU_INSTANCE_PROFILE_4_SLICE
    assert code_of(gpu.profile, 0x12) == NVML_ERROR_INVALID_ARGUMENT  # past PROFILE_COUNT
    assert code_of(gpu.profile, 0x6) == NVML_ERROR_NOT_SUPPORTED  # 6_SLICE: not on an H100
    assert gpu.placements(9) == (Placement(0, 4), Placement(4, 4))  # MIG mode off: still listed
    assert code_of(gpu.placements, 42) == NVML_ERROR_INVALID_ARGUMENT


def test_instances_on_taken_or_overlapping_placements_are_refused() -> None:
    gpu = h100()
    gpu.create_gi(9, Placement(0, 4))
    assert code_of(gpu.create_gi, 9, Placement(0, 4)) == NVML_ERROR_INSUFFICIENT_RESOURCES  # taken
    assert code_of(gpu.create_gi, 19, Placement(2, 1)) == NVML_ERROR_INSUFFICIENT_RESOURCES  # overlaps
    assert code_of(gpu.create_gi, 5) == NVML_ERROR_INSUFFICIENT_RESOURCES  # 4g needs 0:4
    assert code_of(gpu.create_gi, 9, Placement(2, 4)) == NVML_ERROR_INVALID_ARGUMENT  # not a placement
    assert code_of(gpu.create_gi, 77) == NVML_ERROR_INVALID_ARGUMENT  # no such profile id
    assert gpu.remaining(19) == 3 and gpu.remaining(9) == 1 and gpu.remaining(5) == 0
    second = gpu.create_gi(9)
    assert second.placement == Placement(4, 4)
    assert gpu.remaining(19) == 0
    assert code_of(gpu.create_gi, 19) == NVML_ERROR_INSUFFICIENT_RESOURCES  # no capacity left


def test_seven_small_instances_fit_an_h100_and_an_eighth_does_not() -> None:
    gpu = h100()
    ids = [gpu.create_gi(19).id for _ in range(7)]
    assert sorted(ids) == list(range(7, 14))
    assert code_of(gpu.create_gi, 19) == NVML_ERROR_INSUFFICIENT_RESOURCES


def test_compute_instances_and_mig_devices() -> None:
    gpu = h100()
    gi = gpu.create_gi(9, Placement(4, 4))
    cis = [gpu.create_ci(gi.id, 0) for _ in range(3)]  # three 1c.3g.40gb
    assert [c.id for c in cis] == [0, 1, 2]
    assert code_of(gpu.create_ci, gi.id, 0) == NVML_ERROR_INSUFFICIENT_RESOURCES  # 3 slices used
    assert code_of(gpu.create_ci, gi.id, 4) == NVML_ERROR_NOT_SUPPORTED  # 7-slice CI in a 3g GI
    assert code_of(gpu.create_ci, 99, 0) == NVML_ERROR_NOT_FOUND
    devices = gpu.info().devices
    assert [(d.gi, d.ci, d.profile, d.gi_profile) for d in devices] == [
        (gi.id, c, "1c.3g.40gb", "3g.40gb") for c in range(3)
    ]
    first = devices[0]
    assert first.uuid == mig_uuid(UUID, gi.id, 0) and first.uuid.startswith("MIG-")
    assert len({d.uuid for d in devices}) == 3
    assert (first.placement_start, first.placement_size) == (4, 4)
    assert (first.memory_mib, first.sm_count) == (40448, 16)
    assert (first.gi_cap_minor, first.ci_cap_minor) == (3 + 9 * gi.id, 4 + 9 * gi.id)
    assert first.cap_devices == (
        f"/dev/nvidia-caps/nvidia-cap{3 + 9 * gi.id}",
        f"/dev/nvidia-caps/nvidia-cap{4 + 9 * gi.id}",
    )


def test_destroying_needs_it_unused() -> None:
    gpu = h100()
    gi = gpu.create_gi(14)
    ci = gpu.create_ci(gi.id, 1)
    assert code_of(gpu.destroy_gi, gi.id) == NVML_ERROR_IN_USE  # it has a compute instance
    assert code_of(gpu.destroy_ci, gi.id, ci.id, "processes 7 use it") == NVML_ERROR_IN_USE
    gpu.destroy_ci(gi.id, ci.id, None)
    gpu.destroy_gi(gi.id)
    assert code_of(gpu.destroy_gi, gi.id) == NVML_ERROR_NOT_FOUND
    assert gpu.remaining(14) == 3


def test_uuids_are_stable_for_the_same_ids() -> None:
    assert mig_uuid(UUID, 1, 0) == mig_uuid(UUID, 1, 0) != mig_uuid(UUID, 2, 0)
    assert mig_uuid(UUID, 1, 0) != mig_uuid("GPU-other", 1, 0)


def test_the_sim_gpu_mig_option() -> None:
    products = [product("H100-80GB"), product("T4-16GB")]
    assert mig_geometry(["0:1g.10gb, 3g.40gb"], products) == {0: ["1g.10gb", "3g.40gb"]}
    assert mig_geometry(["0:"], products) == {0: []}
    for bad, why in [
        (["1:1g.10gb"], "GPU 1 has no MIG"),
        (["2:"], "no GPU 2"),
        (["x"], "expected GPU:PROFILES"),
        (["0:", "0:1g.10gb"], "names GPU 0 twice"),
    ]:
        with pytest.raises(InvalidSpecError, match=why):
            mig_geometry(bad, products)


def test_a_workload_finds_its_mig_device_in_cuda_visible_devices() -> None:
    assert mig_from_environment({"CUDA_VISIBLE_DEVICES": "MIG-abc,MIG-def"}) == "MIG-abc"
    assert mig_from_environment({"CUDA_VISIBLE_DEVICES": "0"}) is None
    assert mig_from_environment({}) is None
