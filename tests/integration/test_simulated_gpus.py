"""The simulated backend over the GPU server, with real workload processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import GpuLostError, SimulationError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.client import NodeClient, context_times, post_event
from agent.platform.gpu.sim.engineconfig import EngineConfig

CLI = str(Path(sys.executable).with_name("vcuda-agent"))  # the installed console script
PERIOD = 0.2


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    args = ("--sample-period", str(PERIOD), "--sample-delay", "0.1", "--sample-jitter", "0")
    sim = SimulatedBackend("2xH100-80GB", "test-node", short_dir / "sim", server_args=args)
    yield sim
    sim.close()


def workload(sim: SimulatedBackend, gpu: int, *args: str) -> subprocess.Popen[bytes]:
    cmd = [CLI, "sim-workload", "--sim-state-dir", str(sim.root.root), "--gpu", str(gpu), *args]
    return subprocess.Popen(cmd)


def truth(sim: SimulatedBackend) -> dict[int, float]:
    client = NodeClient(sim.root.socket)
    try:
        return context_times(client.truth())
    finally:
        client.close()


def context_rows(sim: SimulatedBackend) -> list[dict[str, Any]]:
    client = NodeClient(sim.root.socket)
    try:
        return [c for g in client.truth()["gpus"] for c in g["contexts"]]
    finally:
        client.close()


def wait_context(sim: SimulatedBackend, pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid in truth(sim):
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} opened no context")


def sampled(sim: SimulatedBackend, gpu: int, pid: int, seconds: float) -> tuple[float, float]:
    """Mean of the process's samples and of the device utilization over ``seconds``, read as
    an NVML consumer reads them; samples must cover the time (one per period)."""
    since = int(time.time() * 1_000_000)
    device = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(PERIOD)
        device.append(sim.device_utilization(gpu))
    time.sleep(0.6)  # the last periods' samples arrive up to 0.5 s late
    until = since + round(seconds * 1_000_000)
    samples = [s.sm_util for s in sim.process_samples(gpu, since) if s.pid == pid and s.timestamp_us <= until]
    periods = int(seconds / PERIOD)
    return sum(samples) / periods, sum(device) / len(device)


def samples_of(sim: SimulatedBackend, gpu: int, pid: int, seconds: float) -> list[int]:
    """The process's samples over the next ``seconds``, each as NVML gives it."""
    since = int(time.time() * 1_000_000)
    time.sleep(seconds + 0.6)
    until = since + round(seconds * 1_000_000)
    return [s.sm_util for s in sim.process_samples(gpu, since) if s.pid == pid and s.timestamp_us <= until]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_inventory_of_the_spec(backend: SimulatedBackend) -> None:
    gpus = backend.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert all(g.memory_mib == 80 * 1024 and g.model == "NVIDIA H100 80GB HBM3" for g in gpus)
    assert len({g.uuid for g in gpus}) == 2 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert backend.topology().link(0, 1).nvlinks == 18
    assert backend.sample_period_s(1) == pytest.approx(PERIOD)


def test_a_busy_workload_reads_full_and_an_idle_one_not_at_all(backend: SimulatedBackend) -> None:
    busy = workload(backend, 0, "--memory-mib", "2048")
    idle = workload(backend, 1, "--memory-mib", "512", "--busy", "0")
    try:
        wait_context(backend, busy.pid)
        wait_context(backend, idle.pid)
        time.sleep(EngineConfig().credit_window_s)  # the driver credits activity over 1 s
        busy_samples = samples_of(backend, 0, busy.pid, 2.0)
        ran_before, started = truth(backend)[busy.pid], time.monotonic()
        _, busy_device = sampled(backend, 0, busy.pid, 1.0)
        ran = 100 * (truth(backend)[busy.pid] - ran_before) / (time.monotonic() - started)
        idle_util, idle_device = sampled(backend, 1, idle.pid, 1.0)
        # NVML reads a busy loop at its SM activity (86.7 % on an H100) in every period; the
        # device reads busy.
        activity = 100 * EngineConfig().sm_activity
        assert len(busy_samples) >= 2.0 / PERIOD - 2, busy_samples
        assert all(activity - 6 <= u <= activity + 1 for u in busy_samples), (
            busy_samples
        )  # less its host gaps
        # The device reads what ran: a busy loop, less the gaps a loaded host leaves in its
        # submissions (CI's two cores, the suite beside it, saw 94.8).
        assert ran >= 85 and busy_device == pytest.approx(ran, abs=4), (busy_device, ran)
        assert idle_util == 0 and idle_device == 0  # no GPU time: no samples at all
        memory = {m.pid: m.used_bytes for m in backend.process_memory(0)}
        assert memory == {busy.pid: 2048 * 1024 * 1024}
    finally:
        stop(busy)
        stop(idle)


def test_a_half_busy_workload_reads_a_quarter_of_its_activity(backend: SimulatedBackend) -> None:
    # The driver credits only the process executing when a period ends (half the periods),
    # with its SM activity over the last second (half of a busy loop's): a share u reads
    # about activity x u^2, not u (docs/gpu-model.md). The device says half.
    half = workload(backend, 1, "--busy", "0.5")
    try:
        wait_context(backend, half.pid)
        time.sleep(EngineConfig().credit_window_s)
        util, device = sampled(backend, 1, half.pid, 3.0)
        expected = 100 * EngineConfig().sm_activity * 0.5**2
        assert expected - 8 <= util <= expected + 8 and 40 <= device <= 60, (util, device)
    finally:
        stop(half)


def test_a_stopped_process_uses_the_gpu_until_its_queue_drains(backend: SimulatedBackend) -> None:
    """What a freeze does: a burn's queued kernels (1024 x 2 ms here) still run, exactly."""
    burn = workload(backend, 0, "--pattern", "burn", "--kernel-ms", "2")
    try:
        wait_context(backend, burn.pid)
        time.sleep(0.5)
        os.kill(burn.pid, signal.SIGSTOP)
        # A launch the process was blocked in (64 kernels) completes as room appears, as the
        # driver call it was in would: after that nothing more is queued.
        time.sleep(0.3)
        (at_stop,) = [c for c in context_rows(backend) if c["pid"] == burn.pid]
        assert at_stop["queued"] >= 1024 - 64 - 150  # kept full, less 0.3 s of drain
        time.sleep(at_stop["pending_s"] / 2)
        (half,) = [c for c in context_rows(backend) if c["pid"] == burn.pid]
        assert half["ran_s"] - at_stop["ran_s"] >= at_stop["pending_s"] / 2 - 0.05  # the GPU is all its
        time.sleep(at_stop["pending_s"] / 2 + 0.5)
        (after,) = [c for c in context_rows(backend) if c["pid"] == burn.pid]
        assert after["ran_s"] - at_stop["ran_s"] == pytest.approx(at_stop["pending_s"], abs=1e-6)
        assert (after["queued"], after["pending_s"]) == (0, 0.0)
    finally:
        stop(burn)


def test_an_exited_workload_is_dropped(backend: SimulatedBackend) -> None:
    proc = workload(backend, 0, "--memory-mib", "100", "--busy", "0", "--duration", "0.5")
    assert proc.wait(timeout=10) == 0
    time.sleep(2 * backend._refresh_s)
    assert backend.process_memory(0) == []
    assert proc.pid not in truth(backend)


def test_the_workload_cli_leaves_on_sigterm(backend: SimulatedBackend) -> None:
    proc = workload(backend, 1, "--memory-mib", "64", "--busy", "0.1")
    wait_context(backend, proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert proc.pid not in truth(backend)


def test_the_workload_rejects_bad_input(backend: SimulatedBackend) -> None:
    base = [CLI, "sim-workload", "--sim-state-dir", str(backend.root.root)]
    bad_gpu = subprocess.run([*base, "--gpu", "7"], capture_output=True, text=True, timeout=30)
    assert bad_gpu.returncode == 1 and "no GPU 7" in bad_gpu.stderr
    bad_busy = subprocess.run(
        [*base, "--gpu", "0", "--busy", "1.5"], capture_output=True, text=True, timeout=30
    )
    assert bad_busy.returncode == 1 and "--busy must be between 0 and 1" in bad_busy.stderr


def test_injected_events(backend: SimulatedBackend) -> None:
    result = subprocess.run(
        [CLI, "sim-event", "--sim-state-dir", str(backend.root.root), "--gpu", "1", "--xid", "48"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    (event,) = backend.wait_events(2.0)
    assert (event.gpu_index, event.kind, event.xid) == (1, EventKind.XID, 48)
    assert backend.wait_events(0.1) == []

    post_event(backend.root.root, 0, "lost")
    assert [e.kind for e in backend.wait_events(2.0)] == [EventKind.LOST]
    with pytest.raises(GpuLostError):
        backend.process_samples(0, 0)
    post_event(backend.root.root, 0, "recovered")
    assert [e.kind for e in backend.wait_events(2.0)] == [EventKind.RECOVERED]
    assert backend.process_samples(0, 0) == []


def test_a_second_agent_on_one_node_is_refused(backend: SimulatedBackend) -> None:
    with pytest.raises(SimulationError, match="another agent uses the simulated node"):
        SimulatedBackend("2xH100-80GB", "test-node", backend.root.root)


def test_an_agent_restart_attaches_to_the_running_gpus(short_dir: Path) -> None:
    server = subprocess.Popen(
        [CLI, "sim-gpu", "--simulate", "1xH100-80GB", "--node-name", "n1", "--sim-state-dir", str(short_dir)]
    )
    try:
        deadline = time.monotonic() + 20
        while not (short_dir / "gpu.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # no wait for node.json: an agent that finds the socket bound before the server
        # has published its node waits for it instead of starting a second server
        for _ in range(2):  # an agent, then its restart: the same server both times
            sim = SimulatedBackend("1xH100-80GB", "n1", short_dir)
            assert sim.node.server_pid == server.pid
            sim.close()
        assert server.poll() is None
        with pytest.raises(SimulationError, match="is 1xH100-80GB named n1"):
            SimulatedBackend("2xH100-80GB", "n1", short_dir)
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0


def test_an_agent_waits_for_a_starting_server_instead_of_starting_a_second(short_dir: Path) -> None:
    """The window between the server binding its socket and publishing node.json: an
    agent that starts in it attaches to that server (a second one would take its socket)."""
    server = subprocess.Popen(
        [CLI, "sim-gpu", "--simulate", "1xH100-80GB", "--node-name", "n1", "--sim-state-dir", str(short_dir)]
    )
    node_file, hidden = short_dir / "node.json", short_dir / "node.json.hidden"
    try:
        deadline = time.monotonic() + 20
        while not node_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        node_file.rename(hidden)  # the server as it is between bind and publish
        publisher = threading.Timer(0.5, hidden.rename, args=(node_file,))
        publisher.start()
        sim = SimulatedBackend("1xH100-80GB", "n1", short_dir)
        try:
            assert sim.node.server_pid == server.pid
        finally:
            sim.close()
            publisher.join()
        assert server.poll() is None
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0
