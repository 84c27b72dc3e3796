"""NvmlBackend against the in-memory fake NVML (no GPU needed)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.errors import (
    DeviceSamplesUnsupportedError,
    GpuLostError,
    NoSuchGpuError,
    NvmlError,
    VcudaError,
)
from agent.platform.gpu.inventory import (
    DeviceEvent,
    DeviceSample,
    EventKind,
    GpuInfo,
    Link,
    ProcessMemory,
    ProcessSample,
    TopologyLevel,
)
from agent.platform.gpu.nvml import NvmlBackend, open_nvml_backend
from agent.platform.gpu.nvml_topology import normalize_bus_id, text
from tests.fakes.fake_nvml import FakeGpu, FakeNvLink, FakeNvml

BUS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]
SWITCH = ["00000000:C1:00.0", "00000000:C2:00.0"]
XID = pynvml.nvmlEventTypeXidCriticalError


def four_gpus() -> list[FakeGpu]:
    """GPUs 0,1: 4 direct NVLinks. GPUs 2,3: behind NVSwitches (6 and 4 active links).

    GPU 1's driver cannot name the far end's device type; GPU 3 reports no XIDs and has
    its NUMA node only in sysfs, like GPU 2.
    """
    return [
        FakeGpu(
            uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
            bus_id=BUS[0],
            minor=0,
            numa_node=0,
            nvlinks=[FakeNvLink(BUS[1]) for _ in range(4)] + [FakeNvLink(BUS[1], active=False)],
        ),
        FakeGpu(
            uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000",
            bus_id=BUS[1],
            minor=1,
            numa_node=0,
            nvlinks=[FakeNvLink(BUS[0]) for _ in range(4)],
            remote_type_supported=False,
        ),
        FakeGpu(
            uuid="GPU-cccccccc-0000-0000-0000-000000000000",
            bus_id=BUS[2],
            minor=2,
            name="NVIDIA H100 80GB HBM3",
            numa_node=None,
            nvlinks=[FakeNvLink.to_switch(SWITCH[i % 2]) for i in range(6)],
        ),
        FakeGpu(
            uuid="GPU-dddddddd-0000-0000-0000-000000000000",
            bus_id=BUS[3],
            minor=3,
            name="NVIDIA H100 80GB HBM3",
            memory_mib=40960,
            numa_node=None,
            nvlinks=[FakeNvLink.to_switch(SWITCH[i % 2], active=i < 4) for i in range(6)],
            supported_events=pynvml.nvmlEventTypeSingleBitEccError,
        ),
    ]


TOPOLOGY = {
    (0, 1): pynvml.NVML_TOPOLOGY_SINGLE,
    (2, 3): pynvml.NVML_TOPOLOGY_INTERNAL,
    (0, 2): pynvml.NVML_TOPOLOGY_SYSTEM,
    (1, 2): pynvml.NVML_TOPOLOGY_NODE,
    (0, 3): pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    (1, 3): pynvml.NVML_TOPOLOGY_MULTIPLE,
}


def write_numa(sysfs: Path, bus_id: str, value: str) -> None:
    device = sysfs / "bus" / "pci" / "devices" / normalize_bus_id(bus_id)
    device.mkdir(parents=True, exist_ok=True)
    (device / "numa_node").write_text(value + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    write_numa(tmp_path, BUS[2], "1")
    write_numa(tmp_path, BUS[3], "-1")
    return tmp_path


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(four_gpus(), TOPOLOGY)


@pytest.fixture
def backend(fake: FakeNvml, sysfs: Path) -> Iterator[NvmlBackend]:
    backend = open_nvml_backend(fake, sysfs_root=sysfs)
    yield backend
    backend.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; the dict gets ``result`` or ``error`` and ``elapsed``."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            out["result"] = fn()
        except VcudaError as err:  # handed to the test thread, which asserts on it
            out["error"] = err
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- inventory ---------------------------------------------------------------------------


def test_inventory_fields(backend: NvmlBackend) -> None:
    assert backend.name == "nvml"
    gpus = list(backend.gpus())
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0] == GpuInfo(
        index=0,
        uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
        model="NVIDIA A100-SXM4-80GB",
        memory_mib=81920,
        minor=0,
        pci_bus_id="00000000:07:00.0",
        numa_node=0,
    )
    assert gpus[3].model == "NVIDIA H100 80GB HBM3"
    assert gpus[3].memory_mib == 40960
    assert gpus[3].device_path == "/dev/nvidia3"
    assert [g.pci_bus_id for g in gpus] == BUS
    assert all(isinstance(g.uuid, str) and isinstance(g.pci_bus_id, str) for g in gpus)


def test_numa_from_nvml_else_sysfs(backend: NvmlBackend) -> None:
    # GPUs 0,1 from nvmlDeviceGetNumaNodeId; 2 from sysfs "1"; 3 from sysfs "-1" -> unknown.
    assert [g.numa_node for g in backend.gpus()] == [0, 0, 1, None]


def test_numa_without_the_nvml_function_reads_sysfs(tmp_path: Path) -> None:
    write_numa(tmp_path, BUS[0], "1")
    write_numa(tmp_path, BUS[1], "0")
    # GPUs 2,3 have no sysfs entry at all: unreadable -> None.
    fake = FakeNvml(four_gpus(), TOPOLOGY, missing={"nvmlDeviceGetNumaNodeId"})
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    try:
        assert [g.numa_node for g in backend.gpus()] == [1, 0, None, None]
        assert fake.call_counts["nvmlDeviceGetNumaNodeId"] == 0
    finally:
        backend.close()


def test_bus_id_helpers() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("00010000:01:1F.7") == "10000:01:1f.7"
    assert text(b"GPU-1234") == "GPU-1234"
    assert text("NVIDIA T4") == "NVIDIA T4"


# --- topology ----------------------------------------------------------------------------


def test_topology_levels_and_nvlinks(backend: NvmlBackend, fake: FakeNvml) -> None:
    topo = backend.topology()
    assert set(topo.links) == {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)}
    # Direct NVLink pair: 4 active links (the inactive fifth does not count), one PCIe switch.
    assert topo.link(1, 0) == Link(TopologyLevel.SINGLE_SWITCH, 4)
    # NVSwitch pair: min(6, 4 active) links.
    assert topo.link(2, 3) == Link(TopologyLevel.BOARD, 4)
    # PCIe only.
    assert topo.link(0, 2) == Link(TopologyLevel.SYSTEM, 0)
    assert topo.link(1, 2) == Link(TopologyLevel.NODE, 0)
    assert topo.link(0, 3) == Link(TopologyLevel.HOSTBRIDGE, 0)
    assert topo.link(1, 3) == Link(TopologyLevel.MULTIPLE_SWITCH, 0)
    # Computed once, then cached.
    calls = fake.call_counts["nvmlDeviceGetTopologyCommonAncestor"]
    assert calls == 6
    assert backend.topology() is topo
    assert fake.call_counts["nvmlDeviceGetTopologyCommonAncestor"] == calls


def test_nvswitch_pair_without_p2p_has_no_nvlinks(fake: FakeNvml, sysfs: Path) -> None:
    fake.fail_call("nvmlDeviceGetP2PStatus", pynvml.NVML_ERROR_NOT_SUPPORTED)
    backend = open_nvml_backend(fake, sysfs_root=sysfs)
    try:
        assert backend.topology().link(2, 3) == Link(TopologyLevel.BOARD, 0)
    finally:
        backend.close()


def test_pcie_only_pair_never_asks_for_p2p(sysfs: Path) -> None:
    gpus = four_gpus()[:2]
    for gpu in gpus:
        gpu.nvlinks = []
    fake = FakeNvml(gpus, {(0, 1): pynvml.NVML_TOPOLOGY_HOSTBRIDGE})
    backend = open_nvml_backend(fake, sysfs_root=sysfs)
    try:
        assert backend.topology().link(0, 1) == Link(TopologyLevel.HOSTBRIDGE, 0)
        assert fake.call_counts["nvmlDeviceGetNvLinkState"] == 2  # link 0 of each: none
        assert fake.call_counts["nvmlDeviceGetP2PStatus"] == 0
    finally:
        backend.close()


def test_topology_on_a_lost_gpu_raises_gpu_lost(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.lose(2)
    with pytest.raises(GpuLostError) as info:
        backend.topology()
    assert info.value.gpu_index == 2


# --- health events -----------------------------------------------------------------------


def test_injected_xid_wakes_a_blocked_wait(backend: NvmlBackend, fake: FakeNvml) -> None:
    thread, out = in_thread(lambda: backend.wait_events(10.0))
    time.sleep(0.1)  # let the thread block inside nvmlEventSetWait
    assert fake.inject_xid(2, 79) == 1
    thread.join(3.0)
    assert not thread.is_alive()
    assert "error" not in out
    assert out["elapsed"] < 3.0
    [event] = out["result"]
    assert event.gpu_index == 2
    assert event.kind is EventKind.XID
    assert event.xid == 79
    assert "79" in event.detail


def test_wait_times_out_empty(backend: NvmlBackend) -> None:
    start = time.monotonic()
    assert backend.wait_events(0.3) == []
    assert 0.25 <= time.monotonic() - start < 2.0


def test_gpu_without_xid_support_logged_once_and_not_watched(
    fake: FakeNvml, sysfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.platform.gpu.nvml"):
        backend = open_nvml_backend(fake, sysfs_root=sysfs)
        try:
            assert fake.inject_xid(3, 48) == 0
            assert fake.inject_xid(0, 31) == 1
            assert backend.wait_events(1.0) == [
                DeviceEvent(0, EventKind.XID, xid=31, detail="NVML reported Xid 31")
            ]
        finally:
            backend.close()
    about_gpu3 = [r for r in caplog.records if "GPU 3" in r.getMessage()]
    assert len(about_gpu3) == 1
    assert "XID" in about_gpu3[0].getMessage()


def test_lost_gpu_reported_once_and_others_still_watched(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.lose(1)
    with pytest.raises(GpuLostError) as info:
        backend.process_samples(1, 0)
    assert info.value.gpu_index == 1
    start = time.monotonic()
    events = backend.wait_events(5.0)
    assert time.monotonic() - start < 1.0
    assert [(e.gpu_index, e.kind) for e in events] == [(1, EventKind.LOST)]
    # Not again: the wait sees the lost GPU, moves to a new event set and times out empty.
    assert backend.wait_events(0.2) == []
    assert fake.live_event_sets == 1
    fake.inject_xid(0, 13)
    assert [(e.gpu_index, e.xid) for e in backend.wait_events(2.0)] == [(0, 13)]
    assert backend.wait_events(0.1) == []


def test_gpu_lost_during_a_blocked_wait(backend: NvmlBackend, fake: FakeNvml) -> None:
    thread, out = in_thread(lambda: backend.wait_events(10.0))
    time.sleep(0.1)
    fake.lose(2)
    thread.join(3.0)
    assert not thread.is_alive()
    assert "error" not in out
    assert [(e.gpu_index, e.kind) for e in out["result"]] == [(2, EventKind.LOST)]
    assert backend.wait_events(0.1) == []
    with pytest.raises(GpuLostError):
        backend.device_utilization(2)
    assert backend.wait_events(0.1) == []  # already reported


def test_reset_required_counts_as_lost(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.fail_call("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_RESET_REQUIRED, index=3)
    with pytest.raises(GpuLostError):
        backend.device_utilization(3)
    assert [(e.gpu_index, e.kind) for e in backend.wait_events(1.0)] == [(3, EventKind.LOST)]


def test_other_wait_errors_raise_nvml_error(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.fail_call("nvmlEventSetWait", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError) as info:
        backend.wait_events(0.1)
    assert info.value.code == pynvml.NVML_ERROR_UNKNOWN


# --- per-process data --------------------------------------------------------------------


def test_process_samples_since_and_not_found(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.set_process_samples(0, [(100, 1_000, 30, 5), (101, 2_000, 60, 7)])
    assert backend.process_samples(0, 0) == [
        ProcessSample(100, 1_000, 30, 5),
        ProcessSample(101, 2_000, 60, 7),
    ]
    assert backend.process_samples(0, 1_500) == [ProcessSample(101, 2_000, 60, 7)]
    assert backend.process_samples(0, 2_000) == []  # NVML_ERROR_NOT_FOUND: nothing new
    assert backend.process_samples(1, 0) == []


def test_process_memory_merges_compute_and_graphics(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.set_processes(
        2,
        compute=[(10, 100 << 20), (11, None)],
        graphics=[(10, 300 << 20), (12, 50 << 20)],
    )
    assert backend.process_memory(2) == [
        ProcessMemory(10, 300 << 20),
        ProcessMemory(11, 0),
        ProcessMemory(12, 50 << 20),
    ]
    assert backend.process_memory(0) == []


def test_driver_older_than_the_binding_is_an_nvml_error(backend: NvmlBackend, fake: FakeNvml) -> None:
    # pynvml raises NVMLLibraryMismatchError, which is not an NVMLError, for these calls.
    fake.fail_call("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, 1)
    with pytest.raises(NvmlError, match="older than nvidia-ml-py expects") as info:
        backend.process_memory(1)
    assert info.value.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND and info.value.gpu_index == 1
    assert backend.process_memory(1) == []


def test_device_utilization(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.set_utilization(1, gpu=87, memory=12)
    assert backend.device_utilization(1) == 87
    assert backend.device_utilization(0) == 0


def test_other_nvml_errors_become_nvml_error(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.fail_call("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_NO_PERMISSION, 0)
    with pytest.raises(NvmlError) as info:
        backend.process_memory(0)
    assert type(info.value) is NvmlError  # not GpuLostError
    assert info.value.code == pynvml.NVML_ERROR_NO_PERMISSION
    assert info.value.gpu_index == 0
    assert isinstance(info.value.__cause__, pynvml.NVMLError_NoPermission)
    assert backend.process_memory(0) == []  # the failure was one call only


# --- device utilization samples (nvmlDeviceGetSamples) ---------------------------------------


def test_device_samples_newer_than_since_with_their_values(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.set_utilization_samples(0, [100_000, 200_000, 300_000], [40, 100, 0])
    assert backend.device_samples(0, 0) == [
        DeviceSample(100_000, 40),
        DeviceSample(200_000, 100),
        DeviceSample(300_000, 0),
    ]
    assert backend.device_samples(0, 100_000) == [DeviceSample(200_000, 100), DeviceSample(300_000, 0)]
    assert backend.device_samples(0, 299_999) == [DeviceSample(300_000, 0)]
    assert backend.device_samples(0, 300_000) == []  # NVML_ERROR_NOT_FOUND: nothing new
    assert backend.device_samples(1, 0) == []  # no samples at all
    assert fake.call_counts["nvmlDeviceGetSamples"] == 5


def test_device_samples_come_back_in_time_order_once_each_and_within_100(
    backend: NvmlBackend, fake: FakeNvml
) -> None:
    """The driver's buffer is a ring, read from wherever it wraps; a timestamp read twice
    is one sample (the later read), and no utilization exceeds 100 %."""
    fake.set_utilization_samples(2, [300, 100, 200, 200, 400], [30, 10, 20, 25, 120])
    assert backend.device_samples(2, 0) == [
        DeviceSample(100, 10),
        DeviceSample(200, 25),
        DeviceSample(300, 30),
        DeviceSample(400, 100),
    ]
    assert backend.device_samples(2, 250) == [DeviceSample(300, 30), DeviceSample(400, 100)]


def test_device_samples_without_values_read_the_current_utilization(
    backend: NvmlBackend, fake: FakeNvml
) -> None:
    fake.set_utilization(3, gpu=55)
    fake.set_utilization_samples(3, [10, 20])
    assert backend.device_samples(3, 0) == [DeviceSample(10, 55), DeviceSample(20, 55)]
    with pytest.raises(ValueError, match="1 values for 2 timestamps"):
        fake.set_utilization_samples(3, [10, 20], [1])


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_device_samples_the_driver_does_not_keep_are_unsupported(
    backend: NvmlBackend, fake: FakeNvml, code: int
) -> None:
    fake.set_utilization_samples(1, [100_000], [70])
    fake.fail_call("nvmlDeviceGetSamples", code, 1)
    with pytest.raises(DeviceSamplesUnsupportedError, match=r"^GPU 1: nvmlDeviceGetSamples: ") as info:
        backend.device_samples(1, 0)
    assert not isinstance(info.value, NvmlError)
    assert isinstance(info.value.__cause__, pynvml.NVMLError)
    assert info.value.__cause__.value == code
    assert backend.device_samples(1, 0) == [DeviceSample(100_000, 70)]  # the failure was one call


def test_device_samples_other_errors(backend: NvmlBackend, fake: FakeNvml) -> None:
    fake.set_utilization_samples(0, [100_000], [70])
    fake.fail_call("nvmlDeviceGetSamples", pynvml.NVML_SUCCESS, 0)  # pynvml: the sizing call found none
    assert backend.device_samples(0, 0) == []
    fake.fail_call("nvmlDeviceGetSamples", pynvml.NVML_ERROR_NO_PERMISSION, 0)
    with pytest.raises(NvmlError) as info:
        backend.device_samples(0, 0)
    assert type(info.value) is NvmlError
    assert (info.value.code, info.value.gpu_index) == (pynvml.NVML_ERROR_NO_PERMISSION, 0)
    fake.lose(0)
    with pytest.raises(GpuLostError):
        backend.device_samples(0, 0)
    assert [(e.gpu_index, e.kind) for e in backend.wait_events(1.0)] == [(0, EventKind.LOST)]


def test_the_sample_period_is_the_median_gap_between_device_samples(
    backend: NvmlBackend, fake: FakeNvml
) -> None:
    fake.set_utilization_samples(0, [166_666, 333_333, 500_000, 666_666, 1_000_000])
    assert backend.sample_period_s(0) == 0.166667  # gaps 166667, 166667, 166666, 333334
    assert backend.sample_period_s(1) is None  # no samples: NOT_FOUND
    fake.set_utilization_samples(2, [5])
    assert backend.sample_period_s(2) is None  # one sample: no gap
    fake.fail_call("nvmlDeviceGetSamples", pynvml.NVML_ERROR_NOT_SUPPORTED, 3)
    assert backend.sample_period_s(3) is None


@pytest.mark.parametrize("index", [-1, 4, 99])
def test_unknown_index(backend: NvmlBackend, index: int) -> None:
    with pytest.raises(NoSuchGpuError):
        backend.process_samples(index, 0)
    with pytest.raises(NoSuchGpuError):
        backend.process_memory(index)
    with pytest.raises(NoSuchGpuError):
        backend.device_utilization(index)


# --- init and lifecycle ------------------------------------------------------------------


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_init_without_driver_points_at_simulate(code: int) -> None:
    fake = FakeNvml(four_gpus())
    fake.fail_init(code)
    with pytest.raises(NvmlError) as info:
        open_nvml_backend(fake)
    assert info.value.code == code
    assert "--simulate" in str(info.value)
    assert "no NVIDIA driver" in str(info.value)
    assert fake.init_count == 0


def test_init_no_permission_says_so() -> None:
    fake = FakeNvml(four_gpus())
    fake.fail_init(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlError, match="permission"):
        open_nvml_backend(fake)


def test_real_pynvml_without_driver_or_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        backend = open_nvml_backend()
    except NvmlError as err:
        assert "--simulate" in str(err)
    else:
        backend.close()
        pytest.skip("this machine has an NVIDIA driver; the no-driver message is not reachable")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(NvmlError, match="--simulate"):
        open_nvml_backend()


def test_failed_start_shuts_nvml_down(sysfs: Path) -> None:
    fake = FakeNvml(four_gpus())
    fake.fail_call("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, index=2)
    with pytest.raises(NvmlError) as info:
        open_nvml_backend(fake, sysfs_root=sysfs)
    assert info.value.gpu_index == 2
    assert fake.init_count == 0
    assert fake.shutdown_calls == 1


def test_close_twice(fake: FakeNvml, sysfs: Path) -> None:
    backend = open_nvml_backend(fake, sysfs_root=sysfs)
    assert fake.live_event_sets == 1
    backend.close()
    backend.close()
    assert fake.shutdown_calls == 1
    assert fake.init_count == 0
    assert fake.live_event_sets == 0
    with pytest.raises(NvmlError):
        backend.device_utilization(0)
    with pytest.raises(NvmlError):
        backend.wait_events(0.1)


def test_close_waits_for_a_blocked_wait(fake: FakeNvml, sysfs: Path) -> None:
    backend = open_nvml_backend(fake, sysfs_root=sysfs)
    thread, out = in_thread(lambda: backend.wait_events(0.5))
    time.sleep(0.1)
    backend.close()  # must not free the event set under the wait
    thread.join(2.0)
    assert not thread.is_alive()
    assert out.get("result") == []
    assert fake.shutdown_calls == 1
    assert fake.live_event_sets == 0


def test_constructor_accepts_an_initialized_module(fake: FakeNvml, sysfs: Path) -> None:
    fake.nvmlInit()
    backend = NvmlBackend(fake, sysfs)
    assert len(backend.gpus()) == 4
    backend.close()
    assert fake.init_count == 0


def _mapped_library(name: str) -> Path:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(name):
            return Path(path)
    raise AssertionError(f"{name} is not mapped into this process")


def _fake_without_library_on_the_path() -> FakeNvml:
    """pynvml's behaviour under plain runc: nvmlInit fails while no library is loaded."""
    fake = FakeNvml(four_gpus())
    fake.nvmlLib = None  # type: ignore[attr-defined]
    init = fake.nvmlInit

    def nvml_init() -> None:
        if fake.nvmlLib is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        init()

    fake.nvmlInit = nvml_init  # type: ignore[method-assign]
    return fake


def test_nvml_is_loaded_from_the_driver_root_when_not_found_by_name(tmp_path: Path, sysfs: Path) -> None:
    lib_dir = tmp_path / "host/usr/lib/x86_64-linux-gnu"
    lib_dir.mkdir(parents=True)
    # A link to a library this process already has: dlopen returns the same handle.
    (lib_dir / "libnvidia-ml.so.1").symlink_to(_mapped_library("libm.so"))
    fake = _fake_without_library_on_the_path()
    backend = open_nvml_backend(fake, sysfs, driver_root=tmp_path / "host")
    try:
        assert fake.nvmlLib is not None
        assert len(backend.gpus()) == 4
    finally:
        backend.close()


def test_no_library_under_the_driver_root_keeps_the_original_error(tmp_path: Path, sysfs: Path) -> None:
    fake = _fake_without_library_on_the_path()
    with pytest.raises(NvmlError, match="no NVIDIA driver") as info:
        open_nvml_backend(fake, sysfs, driver_root=tmp_path)
    assert info.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
