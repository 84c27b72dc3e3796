"""What the agent's SimulatedBackend makes of the GPU server's ``poll``: the driver's
per-process samples aggregated per call as the node's NVML library would (nvmllib), and the
device samples read from their own timestamp. The server is stood in for by its ``poll``
reply (replies.poll_reply, through the wire format) over engines in virtual time, so every
answer can be compared with the engine's own, exactly; and VirtualGpuNode's device samples."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.clock import VirtualClock
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.inventory import DeviceSample, ProcessSample
from agent.platform.gpu.sim import backend as backend_module
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.inventory import sim_gpus
from agent.platform.gpu.sim.nodefile import SimGpuSlot, SimNode
from agent.platform.gpu.sim.perfmon import RING_SAMPLES
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program
from agent.platform.gpu.sim.protocol import decode, encode
from agent.platform.gpu.sim.replies import RequestError, poll_reply
from agent.platform.gpu.sim.spec import parse_simulate_spec

SPEC = "1xH100-80GB"
NODE = "sample-node"
PERIOD = 0.1
PERIOD_US = 100_000
AGGREGATIONS = ("per-sample", "per-call", "per-call-last")


class EnginePoller:
    """The GPU server's side of ``NodeClient.poll``/``subscribe`` over engines in virtual
    time: the same reply function, through the same encoding."""

    def __init__(self, engines: Sequence[GpuEngine], clock: VirtualClock) -> None:
        self.engines = engines
        self.clock = clock
        self.requests: list[dict[str, Any]] = []

    def poll(self, since_us: dict[int, int], device_since_us: dict[int, int]) -> list[dict[str, Any]]:
        request = {
            "op": "poll",
            "since": {str(k): v for k, v in since_us.items()},
            "device_since": {str(k): v for k, v in device_since_us.items()},
        }
        self.requests.append(request)
        reply = poll_reply(self.engines, decode(encode(request)), self.clock.monotonic())
        return list(decode(encode(reply))["gpus"])

    def subscribe(self) -> None:
        pass

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


class Rig:
    """A SimulatedBackend on one engine in virtual time (clock and engine start at 0)."""

    def __init__(
        self, backend: SimulatedBackend, engine: GpuEngine, clock: VirtualClock, poller: EnginePoller
    ):
        self.backend = backend
        self.engine = engine
        self.clock = clock
        self.poller = poller

    def at(self, t: float) -> None:
        self.clock.advance(t - self.clock.monotonic())

    def busy(self, pid: int, seconds: float, at: float = 0.0, **fields: Any) -> None:
        ctx = self.engine.create_context(pid, pid, at, **fields)
        self.engine.submit(ctx, round(seconds / 0.01), 0.01, at)


def slot_for(config: EngineConfig) -> SimGpuSlot:
    """GPU 0's slot in node.json as ``vcuda-agent sim-gpu`` writes it for ``config``."""
    [gpu] = sim_gpus(NODE, parse_simulate_spec(SPEC))
    return SimGpuSlot(
        gpu.index,
        gpu.uuid,
        gpu.model,
        gpu.memory_mib,
        config.sample_period_s,
        config.mps,
        config.nvml_aggregation,
        ring=config.nvml_view == "driver",
    )


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    opened: list[SimulatedBackend] = []

    def make(config: EngineConfig) -> Rig:
        clock = VirtualClock(start=0.0)
        engine = GpuEngine(config, clock.monotonic(), 0.0)
        poller = EnginePoller([engine], clock)
        node = SimNode(NODE, SPEC, os.getpid(), (slot_for(config),))
        monkeypatch.setattr(backend_module, "NodeClient", lambda *_a, **_k: poller)
        monkeypatch.setattr(SimulatedBackend, "_attach_or_start", lambda *_a: node)
        sim = SimulatedBackend(SPEC, NODE, tmp_path / f"sim{len(opened)}", clock=clock, refresh_s=0.0)
        opened.append(sim)
        return Rig(sim, engine, clock, poller)

    yield make
    for sim in opened:
        sim.close()


def config(**fields: Any) -> EngineConfig:
    base: dict[str, Any] = {"sample_period_s": PERIOD, "sample_delay_s": 0.25, "sample_jitter_s": 0.0}
    return EngineConfig(**(base | fields))


def as_process_samples(engine: GpuEngine, since_us: int, now: float) -> list[ProcessSample]:
    return [ProcessSample(s.pid, s.timestamp_us, s.sm_util) for s in engine.samples(since_us, now)]


# Per-process samples ----------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_process_samples_are_the_nvml_librarys_aggregation_of_the_drivers_ring(
    rig: Callable[..., Rig], aggregation: str
) -> None:
    """Two time-sliced processes, samples late by 0.25-0.5 s: at every read, for every
    lastSeenTimeStamp (older than the last poll's included), the backend answers what the
    engine's NVML answers."""
    r = rig(config(nvml_aggregation=aggregation, sample_jitter_s=0.25, seed=5))
    r.busy(1, 5.0)
    r.busy(2, 5.0)
    compared = 0
    last_seen = 0
    for t in (0.3, 0.55, 0.6, 1.07, 1.9, 2.0, 3.33):
        r.at(t)
        for since in sorted({0, last_seen, 200_000, 1_000_000, 1_500_000}):
            got = r.backend.process_samples(0, since)
            assert got == as_process_samples(r.engine, since, t), (t, since)
            compared += bool(got)
        stamps = [s.timestamp_us for s in r.backend.process_samples(0, last_seen)]
        last_seen = max(stamps, default=last_seen)
    assert compared >= 12  # most reads had something to compare


def one_process_config(aggregation: str) -> EngineConfig:
    """Engine credit, SM activity 1, no switches, samples visible at once."""
    return config(
        nvml_aggregation=aggregation,
        sample_credit="engine",
        sm_activity=1.0,
        switch_s=0.0,
        sample_delay_s=0.0,
    )


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("per-sample", [ProcessSample(7, k * PERIOD_US, 100) for k in (1, 2, 3, 4)]),
        ("per-call", [ProcessSample(7, 4 * PERIOD_US, 40)]),  # 400 over the call's 10 samples
        ("per-call-last", []),  # the newest sample (1 s) credits nobody: the GPU idles then
    ],
)
def test_the_nodes_aggregation_is_applied_per_call(
    rig: Callable[..., Rig], aggregation: str, expected: list[ProcessSample]
) -> None:
    """pid 7 runs 0.45 s of work: credited 100 % in periods 1-4; the engine idles at 0.5 s."""
    r = rig(one_process_config(aggregation))
    r.busy(7, 0.45)
    r.at(0.55)
    first = r.backend.process_samples(0, 0)  # the poll that brings periods 1-5
    r.at(1.05)
    assert r.backend.process_samples(0, 0) == expected
    if aggregation == "per-call":
        assert first == [ProcessSample(7, 4 * PERIOD_US, 80)]  # 400 over 5 samples
        assert r.backend.process_samples(0, 2 * PERIOD_US) == [ProcessSample(7, 4 * PERIOD_US, 25)]  # 200 / 8


def test_the_backend_keeps_only_what_the_drivers_ring_holds(rig: Callable[..., Rig]) -> None:
    """pid 1 runs the first 3 s, pid 2 from then on. Read every 0.5 s, the backend receives
    all 105 samples of 10.5 s but, like the driver's ring, keeps the last 72: a per-call
    answer over everything no longer knows pid 1."""
    r = rig(config(nvml_aggregation="per-call", sample_delay_s=0.0))
    r.busy(1, 3.0)
    seen: set[int] = set()
    for half in range(1, 22):
        r.at(half * 0.5)
        if half == 6:
            r.busy(2, 8.0, at=3.0)
        seen |= {s.timestamp_us for s in r.backend.process_samples(0, 0)}
    assert RING_SAMPLES == 72
    assert max(seen) == 105 * PERIOD_US
    got = r.backend.process_samples(0, 0)
    assert [s.pid for s in got] == [2]
    assert got == as_process_samples(r.engine, 0, 10.5)
    oldest_kept = (105 - RING_SAMPLES + 1) * PERIOD_US
    assert r.backend.process_samples(0, oldest_kept - 1) == got  # nothing older is left
    assert r.backend.process_samples(0, oldest_kept) != got


def test_under_the_exact_view_the_backend_passes_samples_through_like_the_engine(
    rig: Callable[..., Rig],
) -> None:
    exact = EngineConfig.ideal(
        sample_period_s=PERIOD, sample_delay_s=0.0, sample_jitter_s=0.0, nvml_aggregation="per-call"
    )
    r = rig(exact)
    r.busy(1, 1.0)
    r.busy(2, 1.0)
    r.at(0.35)
    expected = [ProcessSample(p, k * PERIOD_US, 50) for k in (1, 2, 3) for p in (1, 2)]
    assert as_process_samples(r.engine, 0, 0.35) == expected
    assert r.backend.process_samples(0, 0) == expected


# Device samples and the poll -----------------------------------------------------------------------


def test_the_poll_reads_device_samples_from_their_own_timestamp(rig: Callable[..., Rig]) -> None:
    """Per-process samples arrive 0.25 s late, device samples at once: after a poll at 1.07 s
    the next asks for per-process samples after 0.8 s and device samples after 1.0 s."""
    r = rig(config())
    r.busy(1, 2.0)
    r.at(1.07)
    assert r.backend.device_samples(0, 0) == [DeviceSample(k * PERIOD_US, 100) for k in range(1, 11)]
    assert r.backend.device_utilization(0) == 100
    assert [s.timestamp_us for s in r.backend.process_samples(0, 0)] == [k * PERIOD_US for k in range(1, 9)]
    after_first = {
        "op": "poll",
        "since": {"0": 8 * PERIOD_US},  # the newest driver sample received
        "device_since": {"0": 10 * PERIOD_US},  # the newest device sample received
    }
    assert (
        r.poller.requests == [{"op": "poll", "since": {"0": 0}, "device_since": {"0": 0}}] + [after_first] * 2
    )
    r.at(1.27)
    assert r.backend.device_samples(0, 9 * PERIOD_US) == [
        DeviceSample(k * PERIOD_US, 100) for k in (10, 11, 12)
    ]
    assert r.poller.requests[-1] == after_first
    assert [s.timestamp_us for s in r.backend.process_samples(0, 8 * PERIOD_US)] == [
        9 * PERIOD_US,
        10 * PERIOD_US,
    ]
    assert r.backend.device_samples(0, 12 * PERIOD_US) == []


def test_device_samples_are_read_incrementally_without_gaps_or_repeats(rig: Callable[..., Rig]) -> None:
    """Read at arbitrary instants from the last timestamp seen, the device samples add up to
    exactly the engine's history: one per period, busy including switch time."""
    r = rig(config(switch_s=0.01))
    r.busy(1, 0.25)
    r.busy(2, 0.25, at=0.4)
    seen: list[DeviceSample] = []
    for t in (0.05, 0.13, 0.13, 0.29, 0.61, 0.62, 1.37, 2.01):
        r.at(t)
        seen += r.backend.device_samples(0, seen[-1].timestamp_us if seen else 0)
    assert seen == r.engine.device_samples(0, 2.01)
    assert [s.timestamp_us for s in seen] == [k * PERIOD_US for k in range(1, 21)]
    # 10 ms first load, 250 ms of work; then b's own load at 0.4 s, 250 ms of work.
    assert [s.util for s in seen[:8]] == [100, 100, 60, 0, 100, 100, 60, 0]


def test_poll_refuses_since_that_is_not_a_mapping() -> None:
    engine = GpuEngine(config(), 0.0, 0.0)
    with pytest.raises(RequestError, match="poll: since and device_since must map GPU indexes"):
        poll_reply([engine], {"op": "poll", "since": {}, "device_since": [0]}, 1.0)
    reply = poll_reply([engine], {"op": "poll"}, 0.35)  # neither given: from the start
    assert [gpu["device"] for gpu in reply["gpus"]] == [[[k * PERIOD_US, 0] for k in (1, 2, 3)]]
    assert reply["gpus"][0]["driver"] == [[0, PERIOD_US, 0]]  # the first idle period, 0.25 s late


# VirtualGpuNode ------------------------------------------------------------------------------------------


def test_the_virtual_node_runs_its_programs_before_reading_device_samples() -> None:
    """A train loop at half duty (40 ms steps, 40 ms host time between them) read after
    1.05 s of the clock: a sample for each period, each 40..60 % busy, 13 steps in the first
    second, in line with the engine."""
    clock = VirtualClock(start=0.0)
    node = VirtualGpuNode(clock, [config(switch_s=0.0, host_wake_s=0.0)])
    node.add(
        "a", 0, pattern_program(PatternSpec("train", kernels=20, kernel_ms=2, busy=0.5), WorkloadStats())
    )
    clock.advance(1.05)
    got = node.device_samples(0, 0)
    assert [s.timestamp_us for s in got] == [k * PERIOD_US for k in range(1, 11)]
    assert got == node.node.engines[0].device_samples(0, 1.05)
    assert all(40 <= s.util <= 60 for s in got)
    assert sum(s.util for s in got) == 13 * 40
    assert node.device_samples(0, got[-1].timestamp_us) == []
