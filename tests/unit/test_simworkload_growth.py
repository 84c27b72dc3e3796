"""Simulated workloads that grow: the state dir update and the spec's validation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from agent.errors import InvalidSpecError, SimulationError
from agent.platform.gpu.simstate import SimProcess, SimStateDir
from agent.platform.gpu.simworkload import WorkloadSpec, _burn, _Growth


def test_update_memory_rewrites_the_registration(tmp_path: Path) -> None:
    state = SimStateDir(tmp_path)
    state.create()
    state.register_process(SimProcess(10, 500, 1, 800))
    state.register_process(SimProcess(11, 501, 0, 64))
    assert state.update_memory(10, 1500) == SimProcess(10, 500, 1, 1500)
    assert sorted(state.processes(), key=lambda p: p.pid) == [
        SimProcess(10, 500, 1, 1500),
        SimProcess(11, 501, 0, 64),
    ]
    assert not [p for p in state.procs_dir.iterdir() if p.name.startswith(".tmp-")]


def test_update_memory_of_an_unregistered_process_fails(tmp_path: Path) -> None:
    state = SimStateDir(tmp_path)
    state.create()
    with pytest.raises(SimulationError, match="not registered"):
        state.update_memory(99, 10)


@pytest.mark.parametrize(
    ("grow_to", "after", "message"), [(-1, 0.0, "--grow-to-mib"), (100, -0.5, "--grow-after")]
)
def test_growth_options_are_validated(grow_to: int, after: float, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        WorkloadSpec(gpu=0, memory_mib=1, busy=0.0, grow_to_mib=grow_to, grow_after_s=after).validate()


def test_the_burn_loop_applies_the_growth_once_after_its_deadline() -> None:
    applied: list[float] = []
    start = time.monotonic()
    grow = _Growth(start + 0.1, lambda: applied.append(time.monotonic()))
    spec = WorkloadSpec(gpu=0, memory_mib=1, busy=0.0, duration_s=0.4, period_s=0.02)
    _burn(spec, threading.Event(), grow)
    assert len(applied) == 1
    assert 0.1 <= applied[0] - start <= 0.1 + 0.1  # within a period or so of the deadline
