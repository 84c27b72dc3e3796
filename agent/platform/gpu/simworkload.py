"""A simulated GPU workload: a process pinned to its GPU's CPU core that burns a
chosen share of that core and declares an amount of GPU memory (and, optionally, makes
the driver calls the ioctl tracer attributes: ``simdriver.py``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import InvalidSpecError, PlatformError, SimulationError
from agent.platform.gpu.simdriver import SimDriverCalls
from agent.platform.gpu.simstate import SimProcess, SimStateDir
from agent.platform.procfs import ProcFS


@dataclass(frozen=True)
class WorkloadSpec:
    gpu: int
    memory_mib: int
    busy: float  # share of the core to burn, 0..1
    duration_s: float | None = None  # None: until stopped
    period_s: float = 0.05  # one busy/idle cycle
    grow_to_mib: int | None = None  # after grow_after_s, declare this much memory instead
    grow_after_s: float = 0.0
    driver_ioctls: bool = False  # issue NVIDIA-shaped ioctls for the tracer (simdriver.py)

    def validate(self) -> None:
        if not 0.0 <= self.busy <= 1.0:
            raise InvalidSpecError(f"--busy must be between 0 and 1, got {self.busy}")
        if self.memory_mib < 0:
            raise InvalidSpecError(f"--memory-mib must be >= 0, got {self.memory_mib}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise InvalidSpecError(f"--duration must be > 0, got {self.duration_s}")
        if self.grow_to_mib is not None and self.grow_to_mib < 0:
            raise InvalidSpecError(f"--grow-to-mib must be >= 0, got {self.grow_to_mib}")
        if self.grow_after_s < 0:
            raise InvalidSpecError(f"--grow-after must be >= 0, got {self.grow_after_s}")


def run_workload(state_dir: Path, spec: WorkloadSpec, stop: threading.Event) -> None:
    """Register with the simulated node, burn CPU until ``stop`` or the duration ends."""
    spec.validate()
    state = SimStateDir(state_dir)
    core = state.read_node().core_of(spec.gpu)
    try:
        os.sched_setaffinity(0, {core})
    except OSError as err:
        raise SimulationError(f"cannot pin the workload to CPU core {core}: {err}") from err
    try:
        me = ProcFS().identity(os.getpid())
    except PlatformError as err:
        raise SimulationError(f"cannot read this process's start time: {err}") from err
    driver = SimDriverCalls() if spec.driver_ioctls else None
    if driver is not None:
        driver.allocate(spec.memory_mib)
    state.register_process(SimProcess(me.pid, me.start_ticks, spec.gpu, spec.memory_mib))
    grow = None
    if spec.grow_to_mib is not None:
        grow_to = spec.grow_to_mib

        def apply_growth() -> None:
            if driver is not None:
                driver.allocate(grow_to - spec.memory_mib)
            state.update_memory(me.pid, grow_to)

        grow = _Growth(time.monotonic() + spec.grow_after_s, apply_growth)
    try:
        _burn(spec, stop, grow, driver)
    finally:
        state.unregister_process(me.pid)
        if driver is not None:
            driver.close()


class _Growth:
    """A one-off change of the declared memory at a monotonic deadline."""

    def __init__(self, at: float, apply: Callable[[], object]) -> None:
        self.at = at
        self._apply: Callable[[], object] | None = apply

    def due(self, now: float) -> None:
        if self._apply is not None and now >= self.at:
            apply, self._apply = self._apply, None
            apply()


def _burn(
    spec: WorkloadSpec,
    stop: threading.Event,
    grow: _Growth | None = None,
    driver: SimDriverCalls | None = None,
) -> None:
    """Each period, use ``busy x period`` of CPU time, then sleep to the period's end.

    Pacing by CPU time, not wall time, keeps the share right when the process is
    preempted mid-spin (other processes, VM steal): the spin just takes longer. A pending
    growth is applied at the start of the first cycle past its deadline (within one period).
    """
    end = None if spec.duration_s is None else time.monotonic() + spec.duration_s
    busy_cpu_s = spec.period_s * spec.busy
    cycle_end = time.monotonic()
    while not stop.is_set() and (end is None or time.monotonic() < end):
        if grow is not None:
            grow.due(time.monotonic())
        if driver is not None:
            driver.control()
        cycle_end += spec.period_s
        cpu_start = time.process_time()
        give_up = cycle_end + spec.period_s  # a starved process must still notice stop
        while time.process_time() - cpu_start < busy_cpu_s and time.monotonic() < give_up:
            pass  # burning CPU is the workload
        idle_s = cycle_end - time.monotonic()
        if idle_s > 0:
            if stop.wait(idle_s):
                break
        else:
            cycle_end = time.monotonic()  # overran: start afresh rather than owe time
