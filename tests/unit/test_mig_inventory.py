"""The agent's MIG inventory: the MIG watch over a backend, instance health from XIDs, the
inventory annotation's ``mig`` objects, GFD's MIG labels, the status document and metrics."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from agent.control.health import HealthMonitor
from agent.control.migwatch import MigWatch
from agent.domain.health import HealthBoard, HealthPolicy
from agent.domain.miginventory import (
    MIG_CAPABLE_LABEL,
    MIG_STRATEGY_LABEL,
    decode_mig,
    encode_mig,
    mig_entry,
    mig_labels,
    stale_count_labels,
)
from agent.domain.nodeinventory import InventoryFormatError, build_inventory, decode, encode
from agent.errors import GpuError
from agent.platform.gpu.inventory import DeviceEvent, EventKind, GpuInfo, Topology
from agent.platform.gpu.migstate import NOT_CAPABLE, MigDevice, MigInfo
from agent.surfaces.cli.statusrender import mig_lines
from agent.surfaces.metrics.mig_collector import MigCollector
from agent.surfaces.migstatus import mig_statuses
from agent.surfaces.statusview import gpu_status

GPUS = [
    GpuInfo(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81920, 0, "0:0", 0),
    GpuInfo(1, "GPU-b", "Tesla T4", 15360, 1, "0:1", 0),
]


def device(gi: int, profile: str, place: tuple[int, int], memory: int, index: int = 0) -> MigDevice:
    start, size = place
    uuid = f"MIG-{gi}"
    return MigDevice(0, index, gi, 0, uuid, profile, profile, 9, 2, start, size, memory, 60, 3 + 9 * gi)


MIXED = MigInfo(
    True, True, True, (device(1, "3g.40gb", (0, 4), 40448), device(5, "2g.20gb", (4, 2), 20096, 1))
)


class Backend:
    """What MigWatch reads: ``mig`` per GPU; an exception instance is raised instead."""

    def __init__(self, states: dict[int, MigInfo | Exception]) -> None:
        self.states = states
        self.events: list[DeviceEvent] = []

    def mig(self, index: int) -> MigInfo:
        state = self.states[index]
        if isinstance(state, Exception):
            raise state
        return state

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        events, self.events = self.events, []
        return events


def watch(backend: Backend, board: HealthBoard | None = None) -> MigWatch:
    return MigWatch(backend, GPUS, board)  # type: ignore[arg-type]  # a stand-in backend


def test_the_watch_keeps_the_last_state_of_a_gpu_it_cannot_read(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.control.migwatch")
    backend = Backend({0: MIXED, 1: NOT_CAPABLE})
    mig = watch(backend)
    assert mig.snapshot() == (0, {0: NOT_CAPABLE, 1: NOT_CAPABLE})
    assert mig.refresh() is True
    version, infos = mig.snapshot()
    assert infos[0] == MIXED and version == 1
    assert mig.refresh() is False and mig.snapshot()[0] == 1  # nothing changed
    backend.states[0] = GpuError("GPU 0: nvmlDeviceGetMigMode did not return within 2 s")
    assert mig.refresh() is False and mig.snapshot()[1][0] == MIXED
    assert mig.refresh() is False
    assert caplog.text.count("cannot read its MIG state") == 1  # once per run of failures
    assert "MIG devices: 3g.40gb (GI 1 CI 0, MIG-1)" in caplog.text


def test_an_xid_on_an_instance_marks_the_instance_not_the_gpu() -> None:
    board = HealthBoard([0, 1])
    backend = Backend({0: MIXED, 1: NOT_CAPABLE})
    monitor = HealthMonitor(backend, HealthPolicy(), board)  # type: ignore[arg-type]
    backend.events = [DeviceEvent(0, EventKind.XID, xid=48, detail="ecc", gpu_instance=5)]
    _drain(monitor, backend)
    assert board.is_healthy(0)
    assert list(board.unhealthy_instances()) == [(0, 5)]
    assert "XID 48" in board.unhealthy_instances()[(0, 5)].reason
    backend.events = [DeviceEvent(0, EventKind.XID, xid=13, gpu_instance=1)]  # an application's XID
    _drain(monitor, backend)
    assert list(board.unhealthy_instances()) == [(0, 5)]
    assert board.xids.snapshot() == {(0, 48): 1, (0, 13): 1}
    backend.events = [DeviceEvent(0, EventKind.RECOVERED, detail="reset")]  # a reset clears them
    _drain(monitor, backend)
    assert board.unhealthy_instances() == {}


def _drain(monitor: HealthMonitor, backend: Backend) -> None:
    class Once:
        def __init__(self) -> None:
            self.calls = 0

        def is_set(self) -> bool:
            self.calls += 1
            return self.calls > 1

    monitor.run(Once())  # type: ignore[arg-type]  # one pass of the loop


def test_instances_that_go_lose_their_health_records() -> None:
    board = HealthBoard([0, 1])
    board.set_instance(0, 5, False, "XID 48")
    backend = Backend({0: MIXED, 1: NOT_CAPABLE})
    mig = watch(backend, board)
    mig.refresh()
    assert (0, 5) in board.unhealthy_instances()  # GI 5 still exists
    backend.states[0] = MigInfo(True, True, True, MIXED.devices[:1])
    mig.refresh()
    assert board.unhealthy_instances() == {}


def test_the_annotation_carries_the_mig_side_of_mig_gpus_only() -> None:
    entry = mig_entry(MIXED, unhealthy_gis=[5])
    assert entry is not None and mig_entry(NOT_CAPABLE) is None
    # GPU 0 is in MIG mode, so it offers no shares (withheld): not on demand.
    inventory = build_inventory(
        "n1", GPUS, Topology(), healthy={}, scaling=1.0, heartbeat=1_735_787_045.0, mig={0: entry, 1: None},
        withheld=[0],
    )  # fmt: skip
    raw = json.loads(encode(inventory))
    assert "mig" not in raw["gpus"][1]
    assert raw["gpus"][0]["mig"] == {
        "mode": "enabled",
        "pending": "enabled",
        "devices": [
            {"gi": 1, "ci": 0, "profile": "3g.40gb", "uuid": "MIG-1", "placement": "0:4",
             "memoryMiB": 40448, "healthy": True},
            {"gi": 5, "ci": 0, "profile": "2g.20gb", "uuid": "MIG-5", "placement": "4:2",
             "memoryMiB": 20096, "healthy": False},
        ],
    }  # fmt: skip
    assert decode(encode(inventory)) == inventory
    assert decode_mig(encode_mig(entry)) == entry
    bad = json.loads(encode(inventory))
    bad["gpus"][0]["mig"]["devices"][0]["placement"] = "zero"
    with pytest.raises(InventoryFormatError, match=r"gpus\[0\]\.mig: devices\[0\]\.placement"):
        decode(json.dumps(bad))
    bad["gpus"][0]["mig"] = {"mode": "on", "pending": "enabled", "devices": []}
    with pytest.raises(InventoryFormatError, match="mode must be enabled or disabled"):
        decode(json.dumps(bad))


def test_gfd_mig_labels() -> None:
    assert mig_labels({0: MIXED, 1: NOT_CAPABLE}) == {
        MIG_CAPABLE_LABEL: "true",
        MIG_STRATEGY_LABEL: "mixed",
        "nvidia.com/mig-2g.20gb.count": "1",
        "nvidia.com/mig-3g.40gb.count": "1",
    }
    pending_only = MigInfo(True, False, True, ())
    assert mig_labels({0: pending_only}) == {MIG_CAPABLE_LABEL: "true", MIG_STRATEGY_LABEL: "none"}
    assert mig_labels({1: NOT_CAPABLE}) == {MIG_CAPABLE_LABEL: "false", MIG_STRATEGY_LABEL: "none"}
    current = {"nvidia.com/mig-1g.10gb.count": "7", "nvidia.com/mig.capable": "true", "team": "ml"}
    assert stale_count_labels(current, mig_labels({0: MIXED})) == {"nvidia.com/mig-1g.10gb.count": None}


def test_status_shows_each_mig_device() -> None:
    board = HealthBoard([0, 1])
    board.set_instance(0, 5, False, "XID 48 (double-bit ECC error)")
    statuses = mig_statuses({0: MIXED, 1: NOT_CAPABLE}, board.unhealthy_instances())
    assert list(statuses) == [0]
    assert statuses[0]["mode"] == "enabled"
    assert statuses[0]["devices"][1] == {
        "gi": 5, "ci": 0, "profile": "2g.20gb", "uuid": "MIG-5", "placement": "4:2", "memoryMiB": 20096,
        "smCount": 60, "health": "Unhealthy", "healthReason": "XID 48 (double-bit ECC error)",
        "capDevices": ["/dev/nvidia-caps/nvidia-cap48"],
    }  # fmt: skip
    gpu = gpu_status(
        index=0, uuid="GPU-a", model="H100", healthy=True, memory_total_mib=81920, cores_allocated=0,
        mig=statuses[0],
    )  # fmt: skip
    lines = mig_lines(dict(gpu))
    assert lines[0] == "MIG enabled"
    assert lines[2].split() == [
        "2g.20gb", "GI", "5", "CI", "0", "at", "4:2", "20096", "MiB", "MIG-5", "Unhealthy", "(XID", "48",
        "(double-bit", "ECC", "error))",
    ]  # fmt: skip
    assert mig_lines({"index": 1}) == []  # an older agent, or no MIG
    pending = mig_statuses({0: MigInfo(True, False, True)}, {})[0]
    assert mig_lines({"mig": pending}) == ["MIG disabled (enabled after a GPU reset)"]


def samples(collector: MigCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def test_metrics() -> None:
    board = HealthBoard([0, 1])
    board.set_instance(0, 5, False, "XID 48")
    got = samples(MigCollector(lambda: (1, {0: MIXED, 1: NOT_CAPABLE}), board, GPUS, "n1"))
    assert [v for _, v in got["vcuda_gpu_mig_capable"]] == [1.0, 0.0]
    modes = {(labels["state"], v) for labels, v in got["vcuda_gpu_mig_mode"]}
    assert modes == {("current", 1.0), ("pending", 1.0)}
    counts = [(labels["profile"], v) for labels, v in got["vcuda_mig_devices"]]
    assert counts == [("2g.20gb", 1.0), ("3g.40gb", 1.0)]
    assert [(labels["gi"], v) for labels, v in got["vcuda_mig_device_healthy"]] == [("1", 1.0), ("5", 0.0)]
    memory = dict((labels["uuid"], v) for labels, v in got["vcuda_mig_device_memory_total_bytes"])
    assert memory == {"MIG-1": 40448 * 2**20, "MIG-5": 20096 * 2**20}
    board.set(0, False, "XID 79")  # the GPU itself: every device is unhealthy
    got = samples(MigCollector(lambda: (1, {0: MIXED}), board, GPUS, "n1"))
    assert [v for _, v in got["vcuda_mig_device_healthy"]] == [0.0, 0.0]
