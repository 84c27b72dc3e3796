"""The stop flag that wakes loops waiting on their own work (agent/stopsignal.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from agent.stopsignal import StopSignal, notifier, on_stop


def test_a_callback_runs_once_when_the_flag_is_set_and_at_once_when_it_is_already() -> None:
    stop = StopSignal()
    ran: list[str] = []
    stop.on_set(lambda: ran.append("before"))
    assert ran == [] and stop.waiting() == 1
    stop.set()
    assert ran == ["before"] and stop.is_set() and stop.waiting() == 0
    stop.set()  # again: nothing runs twice
    stop.on_set(lambda: ran.append("after"))
    assert ran == ["before", "after"] and stop.waiting() == 0


def test_a_cancelled_callback_does_not_run_and_a_failing_one_does_not_stop_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = StopSignal()
    ran: list[str] = []
    cancel = stop.on_set(lambda: ran.append("cancelled"))
    stop.on_set(lambda: 1 / 0)
    stop.on_set(lambda: ran.append("kept"))
    cancel()
    cancel()  # twice: still nothing
    assert stop.waiting() == 2
    with caplog.at_level(logging.ERROR, logger="agent.stopsignal"):
        stop.set()
    assert ran == ["kept"]
    assert "a stop callback failed" in caplog.text and "ZeroDivisionError" in caplog.text


def test_a_plain_event_registers_nothing() -> None:
    assert on_stop(threading.Event(), lambda: None) is None
    stop = StopSignal()
    cancel = on_stop(stop, lambda: None)
    assert cancel is not None and stop.waiting() == 1
    cancel()
    assert stop.waiting() == 0


def test_a_condition_waiter_with_no_timeout_is_woken_by_the_flag() -> None:
    stop, condition = StopSignal(), threading.Condition()
    stop.on_set(notifier(condition))
    woke = threading.Event()

    def waiter() -> None:
        with condition:
            while not stop.is_set():  # looked at with the condition held, then waited on
                condition.wait()
        woke.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    stop.set()
    assert woke.wait(10)
    thread.join(10)
