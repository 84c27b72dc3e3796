"""Health policy (which events make a GPU Unhealthy) and the thread-safe HealthBoard."""

from __future__ import annotations

import threading
import time

import pytest

from agent.domain.health import DEFAULT_IGNORED_XIDS, HealthBoard, HealthPolicy
from agent.platform.gpu.inventory import DeviceEvent, EventKind


def xid(number: int | None, gpu: int = 0) -> DeviceEvent:
    return DeviceEvent(gpu, EventKind.XID, xid=number)


# Policy --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "name"),
    [(79, "fallen off the bus"), (48, "double-bit ECC"), (74, "NVLink"), (999, "critical XID")],
)
def test_critical_xid_makes_gpu_unhealthy(number: int, name: str) -> None:
    verdict = HealthPolicy().verdict(xid(number))
    assert verdict is not None
    healthy, reason = verdict
    assert healthy is False
    assert str(number) in reason
    assert name in reason


def test_default_ignored_xids_are_the_application_ones() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == DEFAULT_IGNORED_XIDS


@pytest.mark.parametrize("number", [13, 31, 43, 45, 68, 109])
def test_default_ignored_xids_change_nothing(number: int) -> None:
    assert HealthPolicy().verdict(xid(number)) is None


def test_xid_event_without_a_number_changes_nothing() -> None:
    assert HealthPolicy().verdict(xid(None)) is None


@pytest.mark.parametrize(
    ("number", "unhealthy"),
    [(79, False), (48, False), (13, True), (31, True)],
)
def test_custom_ignored_set_replaces_the_default(number: int, unhealthy: bool) -> None:
    policy = HealthPolicy(ignored_xids=frozenset({79, 48}))
    verdict = policy.verdict(xid(number))
    if unhealthy:
        assert verdict is not None
        assert verdict[0] is False
        assert str(number) in verdict[1]
    else:
        assert verdict is None


@pytest.mark.parametrize(
    ("detail", "in_reason"), [("", "fell off the bus"), ("PCIe link down", "PCIe link down")]
)
def test_lost_is_unhealthy(detail: str, in_reason: str) -> None:
    verdict = HealthPolicy().verdict(DeviceEvent(1, EventKind.LOST, detail=detail))
    assert verdict is not None
    assert verdict[0] is False
    assert "lost" in verdict[1]
    assert in_reason in verdict[1]


@pytest.mark.parametrize(
    ("detail", "reason"), [("", "GPU recovered"), ("reset by operator", "reset by operator")]
)
def test_recovered_is_healthy(detail: str, reason: str) -> None:
    assert HealthPolicy().verdict(DeviceEvent(1, EventKind.RECOVERED, detail=detail)) == (True, reason)


def test_lost_and_recovered_ignore_the_ignored_set() -> None:
    policy = HealthPolicy(ignored_xids=frozenset(range(200)))
    lost = policy.verdict(DeviceEvent(0, EventKind.LOST, xid=79))
    assert lost is not None
    assert lost[0] is False


# Board ---------------------------------------------------------------------


def test_board_starts_healthy_at_version_0() -> None:
    board = HealthBoard([0, 1])
    version, state = board.snapshot()
    assert version == 0
    assert set(state) == {0, 1}
    assert all(h.healthy and h.reason == "" for h in state.values())
    assert board.is_healthy(0)
    assert board.is_healthy(1)


def test_set_reports_only_changes_and_bumps_the_version() -> None:
    board = HealthBoard([0, 1])
    steps = [
        # (index, healthy, changed, version after)
        (0, True, False, 0),
        (0, False, True, 1),
        (0, False, False, 1),
        (1, False, True, 2),
        (0, True, True, 3),
        (0, True, False, 3),
        (7, False, False, 3),  # unknown GPU
    ]
    for index, healthy, changed, version in steps:
        assert board.set(index, healthy, f"reason {version}") is changed, (index, healthy)
        assert board.snapshot()[0] == version
    _, state = board.snapshot()
    assert state[0].healthy is True
    assert state[1].healthy is False
    assert state[1].reason == "reason 2"
    assert not board.is_healthy(1)
    assert 7 not in state


def test_snapshot_is_a_copy() -> None:
    board = HealthBoard([0])
    _, state = board.snapshot()
    board.set(0, False, "XID 79")
    assert state[0].healthy is True
    assert board.snapshot()[1][0].reason == "XID 79"


def test_set_records_since() -> None:
    board = HealthBoard([0])
    before = time.time()
    board.set(0, False, "x")
    assert board.snapshot()[1][0].since >= before


def test_wait_for_change_returns_promptly_when_another_thread_sets() -> None:
    board = HealthBoard([0])
    setter = threading.Timer(0.05, board.set, args=(0, False, "XID 79"))
    start = time.monotonic()
    setter.start()
    try:
        version = board.wait_for_change(0, timeout_s=10.0)
    finally:
        setter.join()
    assert time.monotonic() - start < 1.0
    assert version == 1


def test_wait_for_change_returns_at_once_when_already_past() -> None:
    board = HealthBoard([0])
    board.set(0, False, "x")
    start = time.monotonic()
    assert board.wait_for_change(0, timeout_s=10.0) == 1
    assert time.monotonic() - start < 0.5


def test_wait_for_change_times_out() -> None:
    board = HealthBoard([0])
    start = time.monotonic()
    assert board.wait_for_change(0, timeout_s=0.1) == 0
    elapsed = time.monotonic() - start
    assert 0.09 <= elapsed < 1.0


def test_abort_and_wake_all_end_a_wait_early() -> None:
    board = HealthBoard([0])
    abort = threading.Event()

    def stop() -> None:
        abort.set()
        board.wake_all()

    stopper = threading.Timer(0.05, stop)
    start = time.monotonic()
    stopper.start()
    try:
        version = board.wait_for_change(0, timeout_s=10.0, abort=abort)
    finally:
        stopper.join()
    assert time.monotonic() - start < 1.0
    assert version == 0


def test_abort_already_set_returns_at_once() -> None:
    board = HealthBoard([0])
    abort = threading.Event()
    abort.set()
    start = time.monotonic()
    assert board.wait_for_change(0, timeout_s=10.0, abort=abort) == 0
    assert time.monotonic() - start < 0.5
