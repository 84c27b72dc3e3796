"""The GPU server (`vcuda-agent sim-gpu`) as a real process, with real clients: contexts,
`sim-workload` processes, the agent's SimulatedBackend and injected health events."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.errors import GpuLostError, SimulationError
from agent.platform.gpu.inventory import DeviceEvent, EventKind, ProcessMemory
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.client import Connection, ContextClient, NodeClient, context_times, post_event
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.procfs import ProcFS

SPEC = "2xH100-80GB"
NODE = "test-node"
MIB = 1 << 20
PERIOD_US = 100_000  # --sample-period 0.1


@dataclass
class GpuServerProcess:
    proc: subprocess.Popen[bytes]
    root: SimNodeDir

    def truth(self) -> dict[str, Any]:
        client = NodeClient(self.root.socket)
        try:
            return client.truth()
        finally:
            client.close()

    def contexts(self, gpu: int) -> list[dict[str, Any]]:
        return list(self.truth()["gpus"][gpu]["contexts"])


def sim_command(*args: str) -> list[str]:
    """The light CLI path SimulatedBackend itself starts the server with."""
    return [sys.executable, "-m", "agent", *args]


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_gpu_server(short_dir: Path, *extra: str) -> Iterator[GpuServerProcess]:
    """`sim-gpu` serving SPEC in a short dir (unix socket paths are limited to 107 bytes);
    ``extra``: more sim-gpu options (--driver-mps-v3...)."""
    root = SimNodeDir(short_dir / "sim")
    cmd = sim_command("sim-gpu", "--simulate", SPEC, "--node-name", NODE, "--sim-state-dir", str(root.root))
    cmd += list(extra)
    cmd += ["--sample-period", "0.1", "--sample-delay", "0.05", "--sample-jitter", "0"]
    cmd += ["--log-level", "WARNING"]
    proc = subprocess.Popen(cmd)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"sim-gpu exited with {proc.returncode}"
            try:
                if root.read_node().server_pid != proc.pid:
                    return False
                conn = Connection(root.socket, timeout_s=2.0)
            except SimulationError:
                return False
            try:
                return bool(conn.call({"op": "node"})["ok"])
            finally:
                conn.close()

        wait_for(ready, "the GPU server did not answer")
        yield GpuServerProcess(proc, root)
    finally:
        stop_process(proc)


@pytest.fixture
def gpu_server(short_dir: Path) -> Iterator[GpuServerProcess]:
    with running_gpu_server(short_dir) as server:
        yield server


@pytest.fixture
def workloads() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(sim_dir: Path, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(sim_command("sim-workload", "--sim-state-dir", str(sim_dir), *args))
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            stop_process(proc)


@pytest.fixture
def backends() -> Iterator[Callable[..., SimulatedBackend]]:
    opened: list[SimulatedBackend] = []

    def open_backend(sim_dir: Path, spec: str = SPEC, node_name: str = NODE) -> SimulatedBackend:
        backend = SimulatedBackend(spec, node_name, sim_dir, refresh_s=0.0)
        opened.append(backend)
        return backend

    try:
        yield open_backend
    finally:
        for backend in opened:
            backend.close()


def test_the_server_publishes_its_node_and_cleans_up_on_sigterm(gpu_server: GpuServerProcess) -> None:
    node = gpu_server.root.read_node()
    assert (node.node_name, node.spec, node.server_pid) == (NODE, SPEC, gpu_server.proc.pid)
    assert [(g.index, g.memory_mib, g.sample_period_s, g.mps) for g in node.gpus] == [
        (0, 80 * 1024, 0.1, False),
        (1, 80 * 1024, 0.1, False),
    ]
    gpu_server.proc.send_signal(signal.SIGTERM)
    assert gpu_server.proc.wait(timeout=10) == 0
    assert not gpu_server.root.node_file.exists()
    assert not gpu_server.root.socket.exists()


def test_a_context_launch_and_sync_execute_exactly_that_gpu_time(gpu_server: GpuServerProcess) -> None:
    ctx = ContextClient(gpu_server.root.socket, 1)
    try:
        began = time.monotonic()
        ctx.launch(5, 0.02)
        ctx.graph(10, 0.002)
        ctx.sync()
        waited = time.monotonic() - began
        ctx.alloc(300)
        truth = gpu_server.truth()
    finally:
        ctx.close()
    assert 0.12 <= waited < 2.0  # the sync returned once 120 ms of GPU work had run
    assert context_times(truth) == {os.getpid(): pytest.approx(0.12, abs=1e-9)}
    assert truth["gpus"][0]["contexts"] == [] and truth["gpus"][0]["work_s"] == 0.0
    [mine] = truth["gpus"][1]["contexts"]
    assert (mine["queued"], mine["pending_s"], mine["memory_bytes"]) == (0, 0.0, 300 * MIB)
    assert mine["start_ticks"] == ProcFS().identity(os.getpid()).start_ticks
    # Busy for the work and for loading the context's state once (the first switch).
    assert truth["gpus"][1]["busy_s"] == pytest.approx(0.12 + EngineConfig().switch_s, abs=1e-9)
    wait_for(lambda: gpu_server.contexts(1) == [], "the closed context was not destroyed")


def test_a_workloads_samples_reach_the_backend(
    gpu_server: GpuServerProcess,
    workloads: Callable[..., subprocess.Popen[bytes]],
    backends: Callable[..., SimulatedBackend],
) -> None:
    backend = backends(gpu_server.root.root)
    assert backend.sample_period_s(1) == 0.1
    burn = workloads(gpu_server.root.root, "--gpu", "1", "--pattern", "burn", "--memory-mib", "128")
    mine: list[Any] = []

    def three_full_periods() -> bool:
        mine[:] = [s for s in backend.process_samples(1, 0) if s.pid == burn.pid]
        return len(mine) >= 4

    wait_for(three_full_periods, "no samples of the workload")
    stamps = [s.timestamp_us for s in mine]
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    assert all(abs(step - PERIOD_US) <= 1 for step in steps), stamps  # period ends, ±1 µs rounding
    assert abs(stamps[-1] / 1e6 - time.time()) < 2.0  # wall clock, at most delay + a period old
    # The driver credits the process its SM activity over the credit window (1 s), which
    # fills up from the idle GPU before it: rising, never over its activity.
    utils = [s.sm_util for s in mine[1:]]  # the first period is partial
    assert utils == sorted(utils) and utils[0] > 0 and utils[-1] <= round(100 * EngineConfig().sm_activity)
    assert backend.process_samples(1, stamps[-2])[0] == mine[-1]  # "since" is exclusive
    assert backend.process_memory(1) == [ProcessMemory(burn.pid, 128 * MIB)]
    assert backend.device_utilization(1) == 100
    assert backend.process_samples(0, 0) == [] and backend.process_memory(0) == []
    burn.send_signal(signal.SIGTERM)
    assert burn.wait(timeout=10) == 0
    wait_for(lambda: gpu_server.contexts(1) == [], "the workload's context was not destroyed")
    assert backend.process_memory(1) == []


def test_device_samples_reach_the_backend_for_every_period(
    gpu_server: GpuServerProcess, backends: Callable[..., SimulatedBackend]
) -> None:
    """250 ms of work on GPU 1: its device samples, one per 100 ms period whether busy or
    not, add up to the work (two partial periods round to a whole percent each); GPU 0's are
    all 0. Read again from the newest timestamp, nothing repeats."""
    backend = backends(gpu_server.root.root)
    ctx = ContextClient(gpu_server.root.socket, 1)
    try:
        ctx.launch(5, 0.05)
        ctx.sync()
    finally:
        ctx.close()
    ended = int(time.time() * 1_000_000)
    wait_for(
        lambda: max((s.timestamp_us for s in backend.device_samples(1, 0)), default=0) > ended + PERIOD_US,
        "no device sample after the work",
    )
    device = backend.device_samples(1, 0)
    stamps = [s.timestamp_us for s in device]
    assert all(abs(b - a - PERIOD_US) <= 1 for a, b in itertools.pairwise(stamps)), stamps
    assert 249 <= sum(s.util for s in device) <= 251, device  # 250.25 % of a period, rounded twice
    assert max(s.util for s in device) == 100
    assert {s.util for s in backend.device_samples(0, 0)} == {0}
    assert len(backend.device_samples(0, 0)) >= len(device) - 1  # the idle GPU has them too
    assert backend.device_samples(1, stamps[-1]) == [
        s for s in backend.device_samples(1, 0) if s.timestamp_us > stamps[-1]
    ]
    mine = backend.process_samples(1, 0)
    assert {s.pid for s in mine} <= {os.getpid()}  # credited at the instants it executed, if any
    assert all(0 < s.sm_util <= 87 for s in mine)  # resident credit: at most its SM activity


def test_one_backend_per_node_and_a_second_attaches_once_the_first_closed(
    gpu_server: GpuServerProcess, backends: Callable[..., SimulatedBackend]
) -> None:
    first = backends(gpu_server.root.root)
    assert first.node.server_pid == gpu_server.proc.pid  # attached to the running server
    with pytest.raises(SimulationError, match="another agent uses the simulated node"):
        SimulatedBackend(SPEC, NODE, gpu_server.root.root)
    first.close()
    with pytest.raises(SimulationError, match=f"is {SPEC} named {NODE}, not 1xT4-16GB named {NODE}"):
        SimulatedBackend("1xT4-16GB", NODE, gpu_server.root.root)
    second = backends(gpu_server.root.root)  # the refused ones released the lock
    assert second.node.server_pid == gpu_server.proc.pid
    second.close()
    assert gpu_server.proc.poll() is None  # an attached backend leaves the server running
    assert gpu_server.truth()["ok"] is True


def test_a_malformed_request_gets_an_error_and_the_server_keeps_serving(
    gpu_server: GpuServerProcess,
) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5.0)
    try:
        raw.connect(str(gpu_server.root.socket))
        raw.sendall(b"{not json\n")
        received = b""
        while chunk := raw.recv(4096):  # the reply, then the server closes the connection
            received += chunk
    finally:
        raw.close()
    reply = json.loads(received)
    assert reply["ok"] is False
    assert reply["error"].startswith("malformed message b'{not json': ")
    conn = Connection(gpu_server.root.socket)
    try:
        conn.send({"op": "launch", "count": 1, "kernel_ms": 1})
        assert conn.receive(5.0) == {
            "ok": False,
            "error": "launch before open: no context on this connection",
        }
        conn.send({"op": "fly"})
        assert conn.receive(5.0) == {"ok": False, "error": "unknown op 'fly'"}
        assert conn.call({"op": "node"}) == {
            "ok": True,
            "node_name": NODE,
            "gpus": 2,
            "memory_limits": False,
            "mps_v3": False,
        }
    finally:
        conn.close()


def test_posted_events_reach_wait_events(
    gpu_server: GpuServerProcess, backends: Callable[..., SimulatedBackend]
) -> None:
    backend = backends(gpu_server.root.root)
    time.sleep(0.2)  # the server reads the backend's subscribe before the event's connection
    post_event(gpu_server.root.root, 1, EventKind.XID.value, xid=79, detail="fell off the bus")
    assert backend.wait_events(5.0) == [DeviceEvent(1, EventKind.XID, 79, "fell off the bus")]
    post_event(gpu_server.root.root, 0, EventKind.XID.value, xid=48)
    assert backend.wait_events(5.0) == [DeviceEvent(0, EventKind.XID, 48, "injected")]
    assert backend.wait_events(0.3) == []
    with pytest.raises(SimulationError, match="an xid event needs an integer xid"):
        post_event(gpu_server.root.root, 0, EventKind.XID.value)


def test_a_lost_gpu_fails_its_blocked_sync_and_recovers(
    gpu_server: GpuServerProcess, backends: Callable[..., SimulatedBackend]
) -> None:
    backend = backends(gpu_server.root.root)
    time.sleep(0.2)  # as above: subscribed before the events are posted
    ctx = ContextClient(gpu_server.root.socket, 0)
    failed: list[BaseException] = []

    def sync() -> None:
        try:
            ctx.sync()
        except SimulationError as err:
            failed.append(err)

    try:
        ctx.launch(100, 0.1)  # 10 s of queued work
        waiter = threading.Thread(target=sync)
        waiter.start()
        time.sleep(0.1)
        post_event(gpu_server.root.root, 0, EventKind.LOST.value, detail="gone")
        waiter.join(timeout=5.0)
        assert not waiter.is_alive()
        assert [str(e) for e in failed] == ["GPU 0 is lost (fell off the bus)"]
    finally:
        ctx.close()
    assert backend.wait_events(5.0) == [DeviceEvent(0, EventKind.LOST, None, "gone")]
    with pytest.raises(GpuLostError):
        backend.process_samples(0, 0)
    assert gpu_server.contexts(0) == []
    with pytest.raises(SimulationError, match="GPU 0 is lost"):
        ContextClient(gpu_server.root.socket, 0)
    post_event(gpu_server.root.root, 0, EventKind.RECOVERED.value, detail="reset")
    assert backend.wait_events(5.0) == [DeviceEvent(0, EventKind.RECOVERED, None, "reset")]
    # Readable again: at most the samples of the periods the lost context ran in.
    assert {s.pid for s in backend.process_samples(0, 0)} <= {os.getpid()}
    assert 0.05 <= gpu_server.truth()["gpus"][0]["work_s"] <= 5.0  # run from launch to loss
    ContextClient(gpu_server.root.socket, 0).close()  # opens again
