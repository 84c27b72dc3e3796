"""The node config's MIG geometry put on the simulated GPUs (agent/control/miggeometry.py), over
the GPU server's socket: checked before the GPU is touched, left alone while processes use
the GPU, MIG mode pending until the GPU is reset, then the instances created; each state
logged once and posted as a node Event."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.control.miggeometry import GeometryState, MigGeometry
from agent.control.migwatch import MigWatch
from agent.domain.migconfig import MigConfig, MigStrategy
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.client import ContextClient, NodeClient
from agent.platform.kube.pods import PodInfo
from tests.integration.kubeapi import wait_until

SPEC = "2xH100-80GB,1xT4-16GB"


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, bool]] = []

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        raise AssertionError("no pod events here")

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        self.posted.append((reason, message, warning))


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    sim = SimulatedBackend(SPEC, "mig-node", short_dir / "sim")
    yield sim
    sim.close()


class Rig:
    def __init__(self, backend: SimulatedBackend) -> None:
        self.backend = backend
        self.watch = MigWatch(backend, backend.gpus())
        self.config = MigConfig(MigStrategy.MIXED, {0: ("3g.40gb", "2g.20gb", "1g.10gb")})
        self.events = Events()
        self.geometry = MigGeometry(backend, backend.gpus(), self.watch, lambda: self.config, self.events)

    def state(self, index: int = 0) -> GeometryState:
        return self.geometry.statuses()[index].state

    def reset(self, index: int = 0) -> None:
        client = NodeClient(self.backend.root.socket)
        try:
            client.gpu_reset(index)
        finally:
            client.close()


@pytest.fixture
def rig(backend: SimulatedBackend) -> Rig:
    return Rig(backend)


def test_applied_when_idle_after_the_reset(rig: Rig) -> None:
    assert rig.geometry.apply_once()  # MIG mode enabled: pending a reset
    assert rig.state() is GeometryState.PENDING
    assert "pending a GPU reset (nvidia-smi --gpu-reset -i 0" in rig.geometry.statuses()[0].reason
    assert rig.backend.mig(0).pending and not rig.backend.mig(0).current
    assert rig.geometry.draining() == {0}
    assert not rig.geometry.apply_once()  # nothing more until the reset
    rig.reset()
    assert rig.geometry.apply_once()
    assert rig.state() is GeometryState.APPLIED
    info = rig.backend.mig(0)
    assert sorted(d.profile for d in info.devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert all(d.profile == d.gi_profile for d in info.devices)  # each a whole GPU instance
    assert sorted(d.profile for d in rig.watch.snapshot()[1][0].devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert not rig.geometry.apply_once()  # already there: nothing touched
    assert [(r, w) for r, _, w in rig.events.posted] == [
        ("MIGGeometryPendingReset", False),
        ("MIGGeometryApplied", False),
    ]
    rig.config = MigConfig(MigStrategy.MIXED, {0: ("7g.80gb",)})  # a new geometry replaces the old
    assert rig.geometry.apply_once()
    assert [d.profile for d in rig.backend.mig(0).devices] == ["7g.80gb"]


def test_refused_while_processes_use_the_gpu(rig: Rig) -> None:
    ctx = ContextClient(rig.backend.root.socket, 0)
    try:
        ctx.alloc(100)
        assert not rig.geometry.apply_once()
        status = rig.geometry.statuses()[0]
        assert status.state is GeometryState.WAITING
        assert f"GPU 0 has processes (pids {os.getpid()})" in status.reason
        assert rig.geometry.draining() == {0}  # it takes no new shares meanwhile
        info = rig.backend.mig(0)
        assert not info.pending and not info.current  # untouched
        assert rig.events.posted[-1][0] == "MIGGeometryWaiting" and rig.events.posted[-1][2]
    finally:
        ctx.close()
    wait_until(lambda: not rig.backend.process_memory(0), what="the context gone")  # the server sees EOF
    assert rig.geometry.apply_once()
    assert rig.state() is GeometryState.PENDING


def test_checked_against_the_gpu_before_it_is_touched(rig: Rig) -> None:
    rig.config = MigConfig(
        MigStrategy.MIXED,
        {1: ("4g.40gb", "4g.40gb"), 2: ("1g.10gb",), 7: ("1g.10gb",), 0: ("1g.5gb",)},
    )
    assert not rig.geometry.apply_once()
    statuses = rig.geometry.statuses()
    assert {s.state for s in statuses.values()} == {GeometryState.REFUSED}
    assert "at most 1 4g.40gb on one GPU, 2 asked" in statuses[1].reason
    assert statuses[2].reason == "GPU 2 (Tesla T4) has no MIG"
    assert statuses[7].reason == "the node has no GPU 7"
    assert "a H100-80GB has no MIG profile '1g.5gb'" in statuses[0].reason
    assert not any(rig.backend.mig(i).pending for i in (0, 1))  # nothing was changed
    assert rig.geometry.draining() == set()
    assert len(rig.events.posted) == 4 and all(r == "MIGGeometryRefused" for r, _, _ in rig.events.posted)
    assert not rig.geometry.apply_once()
    assert len(rig.events.posted) == 4  # the same refusal is not posted again
