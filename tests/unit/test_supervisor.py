"""Supervised background tasks: restart with doubling back-off, stop through one event."""

from __future__ import annotations

import itertools
import threading

from agent.clock import VirtualClock
from agent.control.supervisor import Supervisor

WAIT_S = 5.0


def is_running(supervisor: Supervisor, name: str) -> bool:
    return supervisor.tasks[name].running


def test_task_restarted_after_failures_then_stopped() -> None:
    clock = VirtualClock(start=1000.0)
    supervisor = Supervisor(clock=clock, min_backoff_s=0.5, max_backoff_s=30.0)
    calls: list[float] = []
    third_run = threading.Event()

    def task(stop: threading.Event) -> None:
        calls.append(clock.monotonic())
        if len(calls) <= 2:
            raise RuntimeError(f"boom {len(calls)}")
        third_run.set()
        stop.wait()

    supervisor.spawn("flaky", task)
    assert third_run.wait(WAIT_S)
    state = supervisor.tasks["flaky"]
    assert state.restarts == 2
    assert state.last_error == "RuntimeError: boom 2"
    assert is_running(supervisor, "flaky")
    assert calls == [1000.0, 1000.5, 1001.5]  # back-off 0.5 s, then 1 s

    supervisor.stop(timeout_s=WAIT_S)
    assert supervisor.stop_event.is_set()
    assert not is_running(supervisor, "flaky")
    assert len(calls) == 3  # not started again after stop
    assert not any(t.is_alive() for t in threading.enumerate() if t.name == "flaky")


def test_backoff_doubles_and_is_capped() -> None:
    clock = VirtualClock(start=0.0)
    supervisor = Supervisor(clock=clock, min_backoff_s=0.5, max_backoff_s=4.0)
    calls: list[float] = []
    done = threading.Event()

    def task(stop: threading.Event) -> None:
        calls.append(clock.monotonic())
        if len(calls) == 9:
            done.set()
            stop.wait()
            return
        raise ValueError("always")

    supervisor.spawn("crasher", task)
    assert done.wait(WAIT_S)
    supervisor.stop(timeout_s=WAIT_S)
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert supervisor.tasks["crasher"].restarts == 8
    assert supervisor.tasks["crasher"].last_error == "ValueError: always"


def test_backoff_resets_after_a_clean_return() -> None:
    clock = VirtualClock(start=0.0)
    supervisor = Supervisor(clock=clock, min_backoff_s=0.5, max_backoff_s=30.0)
    calls: list[float] = []
    outcomes = ["raise", "raise", "return", "raise", "block"]
    done = threading.Event()

    def task(stop: threading.Event) -> None:
        calls.append(clock.monotonic())
        outcome = outcomes[len(calls) - 1]
        if outcome == "raise":
            raise OSError("flaky")
        if outcome == "block":
            done.set()
            stop.wait()

    supervisor.spawn("resets", task)
    assert done.wait(WAIT_S)
    supervisor.stop(timeout_s=WAIT_S)
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    # Without the reset the last two gaps would be 2.0 and 4.0: after a clean return the
    # next failure starts again from the minimum.
    assert gaps == [0.5, 1.0, 0.5, 0.5]
    assert supervisor.tasks["resets"].restarts == 3


def test_several_tasks_stop_together() -> None:
    supervisor = Supervisor(clock=VirtualClock())
    started = [threading.Event() for _ in range(3)]

    def blocker(index: int) -> None:
        def run(stop: threading.Event) -> None:
            started[index].set()
            stop.wait()

        supervisor.spawn(f"t{index}", run)

    for i in range(3):
        blocker(i)
    assert all(e.wait(WAIT_S) for e in started)
    supervisor.stop(timeout_s=WAIT_S)
    assert all(not s.running for s in supervisor.tasks.values())
    assert all(s.restarts == 0 for s in supervisor.tasks.values())
    assert set(supervisor.tasks) == {"t0", "t1", "t2"}
