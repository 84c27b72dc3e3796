"""The simulated backend with real workload processes pinned to real CPU cores."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import GpuLostError, SimulationError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.simulated import SimulatedBackend

TWO_CORES = len(os.sched_getaffinity(0)) >= 2
CLI = str(Path(sys.executable).with_name("vcuda-agent"))  # the installed console script


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    sim = SimulatedBackend("2xH100-80GB", "test-node", short_dir / "sim", sample_period_s=0.2)
    yield sim
    sim.close()


def wait_registered(sim: SimulatedBackend, gpu: int, count: int = 1, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len([p for p in sim.state.processes() if p.gpu == gpu]) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no workload registered on GPU {gpu}")


def mean_utilization(sim: SimulatedBackend, gpu: int, pid: int, seconds: float) -> tuple[float, float]:
    """Means of the process's samples and of the device utilization read every 0.2 s over
    ``seconds``, as an NVML consumer would read them."""
    since = int(time.time() * 1_000_000)
    sim.process_samples(gpu, since)  # baseline reading
    device: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.2)
        sim.process_samples(gpu, since)
        device.append(sim.device_utilization(gpu))
    samples = [s.sm_util for s in sim.process_samples(gpu, since) if s.pid == pid]
    assert len(samples) >= int(seconds / 0.2) - 2, samples
    return statistics.fmean(samples), statistics.fmean(device)


def test_inventory_of_the_spec(backend: SimulatedBackend) -> None:
    gpus = backend.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert all(g.memory_mib == 80 * 1024 and g.model == "NVIDIA H100 80GB HBM3" for g in gpus)
    assert len({g.uuid for g in gpus}) == 2 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert backend.topology().link(0, 1).nvlinks == 18


def test_busy_workload_reads_full_and_idle_reads_zero(backend: SimulatedBackend) -> None:
    busy = backend.launch_workload(0, memory_mib=2048, busy=1.0)
    idle = backend.launch_workload(1, memory_mib=512, busy=0.0)
    wait_registered(backend, 0)
    wait_registered(backend, 1)
    # The workload pins itself to its GPU's core.
    allowed = Path(f"/proc/{busy.pid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
    assert allowed == str(backend.core_of(0))
    busy_util, busy_device = mean_utilization(backend, 0, busy.pid, 2.0)
    idle_util, idle_device = mean_utilization(backend, 1, idle.pid, 1.0)
    assert busy_util >= 90, busy_util
    assert busy_device >= 85, busy_device
    assert idle_util <= 5, idle_util
    assert idle_device <= 5, idle_device
    memory = {m.pid: m.used_bytes for m in backend.process_memory(0)}
    assert memory == {busy.pid: 2048 * 1024 * 1024}


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPU cores so the half-busy workload is not disturbed")
def test_half_busy_workload_reads_half(backend: SimulatedBackend) -> None:
    half = backend.launch_workload(1, memory_mib=0, busy=0.5)
    wait_registered(backend, 1)
    util, _ = mean_utilization(backend, 1, half.pid, 2.0)
    assert 40 <= util <= 60, util


def test_stopped_workload_reads_zero(backend: SimulatedBackend) -> None:
    """What a cgroup freeze will do later: a stopped process uses no GPU time."""
    busy = backend.launch_workload(0, memory_mib=0, busy=1.0)
    wait_registered(backend, 0)
    os.kill(busy.pid, signal.SIGSTOP)
    try:
        time.sleep(0.3)  # let the running sample window close
        assert mean_utilization(backend, 0, busy.pid, 1.0)[0] <= 5
    finally:
        os.kill(busy.pid, signal.SIGCONT)


def test_exited_workload_is_dropped(backend: SimulatedBackend) -> None:
    proc = backend.launch_workload(0, memory_mib=100, busy=0.0, duration_s=0.3)
    wait_registered(backend, 0)
    proc.wait(timeout=10)
    backend.process_samples(0, 0)
    time.sleep(0.25)
    assert backend.process_memory(0) == []
    assert backend.state.processes() == []


def test_workload_cli_cleans_up_on_sigterm(backend: SimulatedBackend) -> None:
    cmd = [CLI, "sim-workload", "--sim-state-dir", str(backend.state.root), "--gpu", "1"]
    proc = subprocess.Popen([*cmd, "--memory-mib", "64", "--busy", "0.1"])
    wait_registered(backend, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert backend.state.processes() == []


def test_workload_rejects_bad_input(backend: SimulatedBackend) -> None:
    base = [CLI, "sim-workload", "--sim-state-dir", str(backend.state.root)]
    bad_gpu = subprocess.run([*base, "--gpu", "7"], capture_output=True, text=True, timeout=30)
    assert bad_gpu.returncode == 1 and "no GPU 7" in bad_gpu.stderr
    bad_busy = subprocess.run(
        [*base, "--gpu", "0", "--busy", "1.5"], capture_output=True, text=True, timeout=30
    )
    assert bad_busy.returncode == 1 and "--busy must be between 0 and 1" in bad_busy.stderr


def test_injected_events(backend: SimulatedBackend) -> None:
    result = subprocess.run(
        [CLI, "sim-event", "--sim-state-dir", str(backend.state.root), "--gpu", "1", "--xid", "48"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    (event,) = backend.wait_events(2.0)
    assert (event.gpu_index, event.kind, event.xid) == (1, EventKind.XID, 48)
    assert backend.wait_events(0.1) == []

    backend.state.post_event(0, EventKind.LOST)
    assert [e.kind for e in backend.wait_events(2.0)] == [EventKind.LOST]
    with pytest.raises(GpuLostError):
        backend.process_samples(0, 0)
    backend.state.post_event(0, EventKind.RECOVERED)
    backend.wait_events(2.0)
    assert backend.process_samples(0, 0) == []


def test_second_node_on_the_same_state_dir_is_refused(backend: SimulatedBackend) -> None:
    # The claim is per process: a live agent pid other than ours owns the dir.
    holder = subprocess.Popen(["sleep", "30"])
    try:
        node = backend.state.read_node()
        backend.state.write_node(type(node)(node.node_name, holder.pid, node.gpus))
        with pytest.raises(SimulationError, match="another simulated node"):
            SimulatedBackend("1xT4-16GB", "other", backend.state.root)
    finally:
        holder.kill()
        holder.wait()
