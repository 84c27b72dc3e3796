"""The engine under an attached MPS server, and driver memory limits, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest

from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import OutOfMemory
from agent.platform.gpu.sim.perfmon import Sample

MIB = 1 << 20
TOL = 1e-6
SERVER = 900


def make_engine(**fields: Any) -> GpuEngine:
    base: dict[str, Any] = {"sample_period_s": 0.1, "sample_delay_s": 0.0, "sample_jitter_s": 0.0}
    return GpuEngine(EngineConfig.ideal(**(base | fields)), 0.0, 0.0)


def ran(engine: GpuEngine, now: float) -> dict[int, float]:
    return {c.pid: c.ran_s for c in engine.truth(now)}


def test_time_sliced_until_an_mps_server_attaches_then_concurrent_within_shares() -> None:
    engine = make_engine()
    before = engine.mps
    engine.attach_mps_server(SERVER, 0.0)
    assert (before, engine.mps) == (False, True)
    a = engine.create_context(1, 10, 0.0, share=0.3, mps_client=True)
    b = engine.create_context(2, 20, 0.0, share=0.6, mps_client=True)
    engine.submit(a, 1000, 0.02, 0.0)  # burn-like: far more queued than a second holds
    engine.submit(b, 1000, 0.02, 0.0)
    assert ran(engine, 2.0) == pytest.approx({1: 0.6, 2: 1.2}, abs=TOL)


def test_nvml_credits_the_clients_work_to_the_mps_server_by_default() -> None:
    engine = make_engine()
    engine.attach_mps_server(SERVER, 0.0)
    for pid, share in ((1, 0.3), (2, 0.6)):
        ctx = engine.create_context(pid, pid, 0.0, share=share, mps_client=True)
        engine.submit(ctx, 1000, 0.02, 0.0)
    last = [s for s in engine.samples(0, 1.0) if s.timestamp_us == 1_000_000]
    assert last == [Sample(SERVER, 1_000_000, 90)]  # one sample: the server's, the clients' sum
    assert engine.memory() == {}  # memory stays per client (none allocated here)


def test_client_samples_when_the_driver_reports_them_per_client() -> None:
    engine = make_engine(mps_samples="client")
    engine.attach_mps_server(SERVER, 0.0)
    for pid, share in ((1, 0.3), (2, 0.6)):
        ctx = engine.create_context(pid, pid, 0.0, share=share, mps_client=True)
        engine.submit(ctx, 1000, 0.02, 0.0)
    last = sorted((s for s in engine.samples(0, 1.0) if s.timestamp_us == 1_000_000), key=lambda s: s.pid)
    assert last == [Sample(1, 1_000_000, 30), Sample(2, 1_000_000, 60)]


def test_the_clients_go_with_their_mps_server_and_the_gpu_time_slices_again() -> None:
    engine = make_engine()
    engine.attach_mps_server(SERVER, 0.0)
    ctx = engine.create_context(1, 10, 0.0, share=0.3, mps_client=True)
    engine.submit(ctx, 1000, 0.02, 0.0)
    gone = engine.detach_mps_server(1.0)
    assert gone == [ctx] and engine.contexts == [] and not engine.mps
    assert ran(engine, 2.0) == {}
    assert engine.truth(2.0) == []


def test_an_allocation_over_the_pinned_limit_fails() -> None:
    engine = make_engine()
    engine.attach_mps_server(SERVER, 0.0)
    ctx = engine.create_context(1, 10, 0.0, share=0.3, mps_client=True, memory_limit=1024 * MIB)
    engine.allocate(ctx, 1000 * MIB)
    with pytest.raises(OutOfMemory, match="pinned device memory limit of 1024 MiB"):
        engine.allocate(ctx, 100 * MIB)
    assert ctx.memory_bytes == 1000 * MIB  # the failed allocation took nothing
    engine.allocate(ctx, -500 * MIB)
    engine.allocate(ctx, 500 * MIB)


def test_a_cgroup_limit_holds_every_process_below_the_cgroup() -> None:
    engine = make_engine()
    pod = "/sys/fs/cgroup/kubepods/pod1"
    engine.set_cgroup_limit(f"{pod}/ctr", 2048 * MIB)
    a = engine.create_context(1, 10, 0.0, cgroup=f"{pod}/ctr")
    b = engine.create_context(2, 20, 0.0, cgroup=f"{pod}/ctr/container")  # crun's leaf
    other = engine.create_context(3, 30, 0.0, cgroup=f"{pod}/ctr2")  # a sibling, not below it
    engine.allocate(a, 1500 * MIB)
    with pytest.raises(OutOfMemory, match="driver's memory limit of 2048 MiB"):
        engine.allocate(b, 600 * MIB)
    engine.allocate(b, 500 * MIB)
    engine.allocate(other, 4096 * MIB)
    engine.set_cgroup_limit(f"{pod}/ctr", None)
    engine.allocate(b, 4096 * MIB)
