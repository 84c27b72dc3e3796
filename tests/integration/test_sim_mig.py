"""MIG on the simulated GPUs, against the real GPU server over its socket: NVML's MIG calls and
errors, the mode pending until a reset, workloads on MIG devices as real processes, their
isolation, their memory, and XIDs on an instance through the agent's backend."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.control.health import HealthMonitor
from agent.domain.health import HealthBoard, HealthPolicy
from agent.errors import NvmlError, SimulationError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.migprofiles import Placement
from agent.platform.gpu.migstate import MigDevice
from agent.platform.gpu.nvmlcodes import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
)
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.client import ContextClient, NodeClient, post_event
from agent.platform.gpu.sim.migclient import SimNvml, gpm_sm_util
from tests.integration.kubeapi import wait_until

SPEC = "2xH100-80GB,1xT4-16GB"  # GPU 0 in MIG mode (2g.20gb at 4:2, 3g.40gb at 0:4), GPU 1 not
H100_SMS = 132


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    args = ("--mig", "0:2g.20gb,3g.40gb", "--sample-period", "0.2", "--sample-delay", "0.1")
    sim = SimulatedBackend(SPEC, "mig-node", short_dir / "sim", server_args=args)
    yield sim
    sim.close()


@pytest.fixture
def nvml(backend: SimulatedBackend) -> Iterator[SimNvml]:
    with SimNvml(backend.root.socket) as client:
        yield client


def code_of(call: Callable[..., Any], *args: Any) -> int:
    with pytest.raises(NvmlError) as caught:
        call(*args)
    return caught.value.code


def workload(sim: SimulatedBackend, gpu: int, *args: str) -> subprocess.Popen[bytes]:
    # The light CLI path (python -m agent sim-...): a workload starts in a fraction of a second.
    cmd = [sys.executable, "-m", "agent", "sim-workload", "--sim-state-dir", str(sim.root.root)]
    cmd += ["--gpu", str(gpu), *args]
    return subprocess.Popen(cmd)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def mig_truth(sim: SimulatedBackend) -> dict[str, Any]:
    client = NodeClient(sim.root.socket)
    try:
        return client.mig_truth()
    finally:
        client.close()


def device_contexts(sim: SimulatedBackend, uuid: str) -> list[dict[str, Any]]:
    return [c for d in mig_truth(sim)["devices"] if d["uuid"] == uuid for c in d["contexts"]]


def by_profile(sim: SimulatedBackend) -> dict[str, MigDevice]:
    return {d.profile: d for d in sim.mig(0).devices}


def test_the_backend_reads_modes_and_devices(backend: SimulatedBackend) -> None:
    info = backend.mig(0)
    assert (info.capable, info.current, info.pending) == (True, True, True)
    assert [(d.profile, d.gi, d.ci, d.placement_start, d.placement_size) for d in info.devices] == [
        ("3g.40gb", 1, 0, 0, 4),
        ("2g.20gb", 5, 0, 4, 2),
    ]
    assert [(d.memory_mib, d.sm_count, d.gi_cap_minor, d.ci_cap_minor) for d in info.devices] == [
        (40448, 60, 12, 13),
        (20096, 32, 48, 49),
    ]
    assert all(d.uuid.startswith("MIG-") for d in info.devices)
    assert not backend.mig(1).current and not backend.mig(2).capable


def test_nvml_calls_and_their_errors_over_the_socket(backend: SimulatedBackend, nvml: SimNvml) -> None:
    assert nvml.nvmlDeviceGetMigMode(0) == [1, 1]
    assert code_of(nvml.nvmlDeviceGetMigMode, 2) == NVML_ERROR_NOT_SUPPORTED  # a T4 has no MIG
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(0, 3).name == "MIG 4g.40gb"
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(0, 14) == [Placement(s, 2) for s in (0, 2, 4)]
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(0, 19) == 1  # slot 6 only
    assert code_of(nvml.nvmlDeviceCreateGpuInstance, 0, 5) == NVML_ERROR_INSUFFICIENT_RESOURCES
    assert (
        code_of(nvml.nvmlDeviceCreateGpuInstanceWithPlacement, 0, 19, Placement(4, 1))
        == NVML_ERROR_INSUFFICIENT_RESOURCES
    )  # inside the 2g
    assert (
        code_of(nvml.nvmlDeviceCreateGpuInstanceWithPlacement, 0, 9, Placement(2, 4))
        == NVML_ERROR_INVALID_ARGUMENT
    )
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(0, 19, Placement(6, 1))
    assert (gi.id, nvml.nvmlGpuInstanceGetInfo(gi).placement) == (13, Placement(6, 1))
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(0) == 7
    handles = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(0, i) for i in range(3)]
    assert [(h.gi, h.ci) for h in handles] == [(1, 0), (5, 0), (13, 0)]
    assert code_of(nvml.nvmlDeviceGetMigDeviceHandleByIndex, 0, 3) == NVML_ERROR_NOT_FOUND
    small = handles[2]
    assert nvml.nvmlDeviceIsMigDeviceHandle(small) and not nvml.nvmlDeviceIsMigDeviceHandle(0)
    assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(small) == 0
    assert nvml.nvmlDeviceGetMemoryInfo(small).total == 9984 << 20
    assert code_of(nvml.nvmlDeviceGetUtilizationRates, small) == NVML_ERROR_NOT_SUPPORTED
    assert code_of(nvml.nvmlDeviceGetProcessUtilization, small) == NVML_ERROR_NOT_SUPPORTED
    assert code_of(nvml.nvmlDeviceGetUtilizationRates, 0) == NVML_ERROR_NOT_SUPPORTED  # the MIG GPU

    proc = workload(backend, 0, "--mig", small.uuid, "--pattern", "burn")
    try:
        wait_until(
            lambda: device_contexts(backend, small.uuid), what="the workload's context on the 1g device"
        )
        assert code_of(nvml.nvmlComputeInstanceDestroy, ci) == NVML_ERROR_IN_USE  # a process uses it
        assert code_of(nvml.nvmlDeviceSetMigMode, 0, 0) == NVML_ERROR_IN_USE
    finally:
        stop(proc)
    wait_until(lambda: not device_contexts(backend, small.uuid), what="the context gone with the process")
    assert code_of(nvml.nvmlGpuInstanceDestroy, gi) == NVML_ERROR_IN_USE  # its CI is still there
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    assert [d.gi for d in backend.mig(0).devices] == [1, 5]


def test_a_mode_change_waits_for_a_gpu_reset(backend: SimulatedBackend, nvml: SimNvml) -> None:
    assert nvml.nvmlDeviceSetMigMode(1, 1) == NVML_ERROR_RESET_REQUIRED
    info = backend.mig(1)
    assert (info.current, info.pending, info.change_pending) == (False, True, True)
    assert code_of(nvml.nvmlDeviceCreateGpuInstance, 1, 19) == NVML_ERROR_NOT_SUPPORTED  # not yet
    proc = workload(backend, 1, "--pattern", "burn")  # the GPU still runs whole-GPU contexts
    client = NodeClient(backend.root.socket)
    try:
        wait_until(lambda: backend.process_memory(1) or _has_context(client, 1), what="a context on GPU 1")
        with pytest.raises(SimulationError, match="cannot reset"):
            client.gpu_reset(1)  # a process uses it
        stop(proc)
        wait_until(lambda: not _has_context(client, 1), what="the context gone")
        assert client.gpu_reset(1) == {"ok": True, "current": 1, "pending": 1}
        assert nvml.nvmlDeviceGetMigMode(1) == [1, 1]
        with pytest.raises(SimulationError, match="MIG mode"):
            ContextClient(backend.root.socket, 1)  # only MIG devices run work now
    finally:
        stop(proc)
        client.close()


def _has_context(client: NodeClient, gpu: int) -> bool:
    return bool(client.truth()["gpus"][gpu]["contexts"])


def test_a_2g_instance_gets_at_most_its_share_beside_a_busy_neighbour(backend: SimulatedBackend) -> None:
    devices = by_profile(backend)
    two, three = devices["2g.20gb"], devices["3g.40gb"]
    neighbour = workload(backend, 0, "--mig", three.uuid, "--pattern", "burn", "--kernel-ms", "50")
    tenant = workload(backend, 0, "--mig", two.uuid, "--pattern", "burn", "--kernels", "4096")
    try:
        wait_until(
            lambda: device_contexts(backend, two.uuid) and device_contexts(backend, three.uuid),
            what="both workloads' contexts",
        )
        first = mig_truth(backend)
        wait_until(lambda: mig_truth(backend)["monotonic"] - first["monotonic"] >= 1.0, what="a second")
        second = mig_truth(backend)
    finally:
        stop(neighbour)
        stop(tenant)
    elapsed = float(second["monotonic"]) - float(first["monotonic"])

    def rate(uuid: str) -> float:
        work = [sum(float(c["work_s"]) for c in d["contexts"]) for t in (first, second) for d in t["devices"]
                if d["uuid"] == uuid]  # fmt: skip
        return (work[1] - work[0]) / elapsed

    # Work in seconds of the whole GPU per second: the 2g device's 32 of 132 SMs, under 2/7,
    # however deep its queue and whatever the 3g neighbour runs; and all of that share.
    assert rate(two.uuid) <= 2 / 7
    assert rate(two.uuid) == pytest.approx(32 / H100_SMS, rel=0.03)
    assert rate(three.uuid) == pytest.approx(60 / H100_SMS, rel=0.03)


def test_memory_is_the_instances(backend: SimulatedBackend, nvml: SimNvml) -> None:
    two = by_profile(backend)["2g.20gb"]
    ctx = ContextClient(backend.root.socket, 0, mig=two.uuid)
    try:
        ctx.alloc(20000)
        with pytest.raises(SimulationError, match="out of memory"):
            ctx.alloc(200)  # 20096 MiB is the instance's
        memory = {p.used_bytes for p in backend.process_memory(0)}
        assert 20000 << 20 in memory  # NVML lists the instance's processes on the parent GPU
        handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(0, 1)
        assert nvml.nvmlDeviceGetMemoryInfo(handle).used == 20000 << 20
        before = nvml.nvmlGpmMigSampleGet(0, two.gi)
        ctx.launch(2, 0.05)
        ctx.sync()
        after = nvml.nvmlGpmMigSampleGet(0, two.gi)
        assert gpm_sm_util(before, after) > 0  # the GPM-like activity of the GPU instance
    finally:
        ctx.close()


def test_an_xid_on_an_instance_marks_that_instance(backend: SimulatedBackend) -> None:
    board = HealthBoard([0, 1, 2])
    monitor = HealthMonitor(backend, HealthPolicy(), board, wait_s=0.1)
    stop_event = threading.Event()
    thread = threading.Thread(target=monitor.run, args=(stop_event,), daemon=True)
    thread.start()
    try:
        with pytest.raises(SimulationError, match="no GPU instance 9"):
            post_event(backend.root.root, 0, EventKind.XID.value, 48, gpu_instance=9)
        post_event(backend.root.root, 0, EventKind.XID.value, 48, "ecc", gpu_instance=5)
        wait_until(lambda: (0, 5) in board.unhealthy_instances(), what="GI 5 Unhealthy")
        assert board.is_healthy(0)  # the GPU and its other instance are fine
        assert list(board.unhealthy_instances()) == [(0, 5)]
    finally:
        stop_event.set()
        thread.join(timeout=5)
