"""The GPU script's MIG record (bench/gpu_mig.py, in ``inventory.json`` under
``nvidia.gpus[].mig``) against the fake NVML with MIG: capability, current and pending mode,
every GPU-instance profile as pynvml's struct has it, placements and remaining capacity, the
MIG devices that exist; and nothing but read calls: no mode change, no instance created or
destroyed, whatever the GPU's state.

What needs a lent MIG-capable GPU: the real driver's answers (profile indexes past the
documented ones, placements out of MIG mode)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_inventory import nvml_inventory  # noqa: E402
from gpu_mig import READ_CALLS, mig_facts  # noqa: E402

from tests.fakes.fake_nvml import FakeGpu  # noqa: E402
from tests.fakes.fake_nvml_mig import FakeMigNvml  # noqa: E402

H100, H100_OFF, T4 = (f"GPU-{c * 8}-0000-0000-0000-000000000000" for c in "abc")
CHANGES = ("SetMigMode", "Create", "Destroy", "Reset")  # what the script must never call


class MigReadNvml(FakeMigNvml):
    """The fake with pynvml's possible-placement and remaining-capacity calls, over the same
    MIG state (pynvml fills the caller's C array and count for the placements)."""

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetGpuInstancePossiblePlacements", device)
        found = self._call(gpu.placements, profileId)
        count = countRef._obj  # pynvml passes ctypes.byref(c_uint)
        if count.value < len(found):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, placement in enumerate(found):
            placementsRef[i].start, placementsRef[i].size = placement.start, placement.size
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetGpuInstanceRemainingCapacity", device)
        return int(self._call(gpu.remaining, profileId))


class Recorded:
    """The binding as the script sees it, with every NVML function it calls recorded."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.called: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.called.append(name)
            return value(*args, **kwargs)

        return call


def fake() -> MigReadNvml:
    """GPU 0: an H100 in MIG mode with a 3g.40gb and a 2g.20gb; GPU 1: an H100 whose MIG mode
    is pending a reset; GPU 2: a T4 (no MIG)."""
    gpus = [
        FakeGpu(H100, "00000000:07:00.0", 0, name="NVIDIA H100 80GB HBM3"),
        FakeGpu(H100_OFF, "00000000:08:00.0", 1, name="NVIDIA H100 80GB HBM3"),
        FakeGpu(T4, "00000000:0F:00.0", 2, name="Tesla T4", memory_mib=15360),
    ]
    nvml = MigReadNvml(gpus, mig={0: "H100-80GB", 1: "H100-80GB"})
    nvml.nvmlInit()
    gpu = nvml.mig(0)
    gpu.set_mode(1, None)
    gpu.reset(None)
    for profile_id, ci_profile in ((9, 2), (14, 1)):  # 3g.40gb, 2g.20gb, each a whole CI
        gpu.create_ci(gpu.create_gi(profile_id).id, ci_profile)
    nvml.mig(1).set_mode(1, None)
    return nvml


def state(nvml: MigReadNvml) -> list[Any]:
    return [(g.current, g.pending, [d.uuid for d in g.info().devices]) for g in map(nvml.mig, (0, 1))]


def read(nvml: MigReadNvml, index: int) -> tuple[dict[str, Any], list[str]]:
    recorded = Recorded(nvml)
    facts = mig_facts(recorded, nvml.nvmlDeviceGetHandleByIndex(index))  # type: ignore[arg-type]
    return facts, recorded.called


def by_index(facts: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["index"]: p for p in facts["profiles"]}


def test_a_gpu_in_mig_mode_records_its_profiles_placements_and_devices() -> None:
    nvml = fake()
    before = state(nvml)
    facts, called = read(nvml, 0)
    assert (facts["capable"], facts["current"], facts["pending"]) == (True, "enabled", "enabled")
    profiles = by_index(facts)
    assert len(profiles) == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT  # every index asked
    one = profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE]
    assert (one["name"], one["id"], one["sliceCount"], one["instanceCount"]) == ("MIG 1g.10gb", 19, 1, 7)
    assert (one["memorySizeMB"], one["multiprocessorCount"]) == (9984, 16)
    assert one["placements"] == [f"{s}:1" for s in range(7)]
    three = profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE]
    assert (three["name"], three["id"], three["multiprocessorCount"]) == ("MIG 3g.40gb", 9, 60)
    assert three["placements"] == ["0:4", "4:4"] and three["remaining"] == 0  # 0:4 overlaps the 2g
    assert profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE]["remaining"] == 1
    missing = profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT - 1]
    assert "error" in missing and "name" not in missing  # an index the product lacks: NVML's answer
    uuids = [d.uuid for d in nvml.mig(0).info().devices]
    assert [d["uuid"] for d in facts["devices"]] == uuids
    assert sorted(d["memory_mib"] for d in facts["devices"]) == [20096, 40448]
    assert_read_only(nvml, before, called)


def test_pending_and_no_mig_are_recorded_and_nothing_is_changed() -> None:
    nvml = fake()
    before = state(nvml)
    pending, called = read(nvml, 1)
    assert (pending["capable"], pending["current"], pending["pending"]) == (True, "disabled", "enabled")
    assert pending["devices"] == []
    t4, more = read(nvml, 2)
    assert t4["capable"] is False and "nvmlDeviceGetMigMode" in t4["reason"]
    assert_read_only(nvml, before, called + more)


def assert_read_only(nvml: MigReadNvml, before: list[Any], called: list[str]) -> None:
    assert set(called) <= READ_CALLS, sorted(set(called) - READ_CALLS)
    assert not [name for name in called if any(word in name for word in CHANGES)]
    assert state(nvml) == before
    source = (ROOT / "bench" / "gpu_mig.py").read_text()
    changing: Callable[[str], bool] = lambda name: any(word in name for word in CHANGES)  # noqa: E731
    assert not [name for name in dir(pynvml) if name.startswith("nvml") and changing(name) and name in source]


def test_the_inventory_carries_each_gpus_mig_record_as_json() -> None:
    nvml = fake()
    facts = json.loads(json.dumps(nvml_inventory(nvml)))  # what inventory.json holds
    migs = [gpu["mig"] for gpu in facts["gpus"]]
    assert [m["capable"] for m in migs] == [True, True, False]
    assert by_index(migs[0])[pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE]["name"] == "MIG 7g.80gb"
