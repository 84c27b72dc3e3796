"""The process cache over a fake /proc tree and scripted process events, in virtual time."""

from __future__ import annotations

import errno
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.clock import VirtualClock
from agent.platform.procevents import (
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    PROC_EVENT_NONE,
    EventKind,
    ProcessCache,
    ProcessChange,
    ProcEvent,
    ProcEventsLost,
    ProcEventsUnavailable,
    events_from_datagram,
    listen_error,
)
from agent.platform.procfs import ProcessIdentity, ProcFS


class FakeProc:
    """A /proc with a stat file per process and a per-pid value the resolver returns."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.values: dict[int, str | None] = {}
        self.resolved: list[int] = []

    def start(self, pid: int, start_ticks: int, value: str | None, state: str = "S") -> None:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(
            f"{pid} (proc) {state} 1 {pid} {pid} 0 -1 0 0 0 0 0 1 2 0 0 20 0 1 0 {start_ticks} 0 0\n"
        )
        self.values[pid] = value

    def exit(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))

    def resolve(self, pid: int) -> str | None:
        self.resolved.append(pid)
        return self.values.get(pid)


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


def make_cache(proc: FakeProc, **kwargs: Any) -> tuple[ProcessCache[str], list[ProcessChange[str]]]:
    cache: ProcessCache[str] = ProcessCache(proc.resolve, procfs=ProcFS(proc.root), **kwargs)
    changes: list[ProcessChange[str]] = []
    cache.subscribe(changes.append)
    return cache, changes


def cn_proc_message(what: int, *ids: int) -> bytes:
    """One netlink message as the kernel sends it: nlmsghdr, cn_msg, proc_event."""
    data = struct.pack("=IIQ", what, 0, 123) + struct.pack(f"={len(ids)}I", *ids)
    data += bytes(-len(data) % 4 + 8)  # the union is larger than most members
    cn_msg = struct.pack("=IIIIHH", 1, 1, 0, 0, len(data), 0)
    return struct.pack("=IHHII", 16 + 20 + len(data), 3, 0, 0, 0) + cn_msg + data


def test_datagrams_become_process_events_and_thread_events_are_dropped() -> None:
    datagram = b"".join(
        [
            cn_proc_message(PROC_EVENT_FORK, 1, 1, 10, 10),
            cn_proc_message(PROC_EVENT_FORK, 10, 10, 11, 10),  # a thread
            cn_proc_message(PROC_EVENT_EXEC, 10, 10),
            cn_proc_message(0x200, 10, 10),  # comm change: ignored
            cn_proc_message(PROC_EVENT_EXIT, 11, 10, 0, 17, 1, 1),  # the thread exits
            cn_proc_message(PROC_EVENT_EXIT, 10, 10, 0, 17, 1, 1),
        ]
    )
    assert events_from_datagram(datagram) == [
        ProcEvent(EventKind.FORK, 10),
        ProcEvent(EventKind.EXEC, 10),
        ProcEvent(EventKind.EXIT, 10),
    ]


def test_a_truncated_datagram_yields_what_is_whole() -> None:
    whole = cn_proc_message(PROC_EVENT_EXEC, 7, 7)
    assert events_from_datagram(whole + whole[:30]) == [ProcEvent(EventKind.EXEC, 7)]
    assert events_from_datagram(b"") == []
    assert events_from_datagram(struct.pack("=IHHII", 0, 3, 0, 0, 0) + bytes(60)) == []


class AckMessage(dict[str, int]):
    """pyroute2's parsed answer to the listen request: the raw datagram behind it."""

    def __init__(self, err: int) -> None:
        super().__init__(what=PROC_EVENT_NONE)
        header = struct.pack("=IHHII", 76, 3, 0, 1, 0)
        cn_msg = struct.pack("=IIIIHH", 1, 1, 1, 0, 40, 0)
        event = struct.pack("=IIQI", PROC_EVENT_NONE, 0, 123, err) + bytes(20)
        self.data, self.offset = header + cn_msg + event, 0


def test_the_kernels_refusal_to_subscribe_is_read_from_the_answer() -> None:
    assert listen_error([AckMessage(0)]) == 0
    assert listen_error([AckMessage(errno.EPERM)]) == errno.EPERM
    assert listen_error([]) == 0


def test_exec_adds_and_notifies_exit_drops_at_once(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    proc.start(100, 5000, "pod-a/ctr")
    cache.handle(ProcEvent(EventKind.EXEC, 100))
    assert cache.processes()[100].identity == ProcessIdentity(100, 5000)
    assert cache.get(100) == "pod-a/ctr"
    assert cache.identity(100) == ProcessIdentity(100, 5000) and cache.identity(101) is None
    cache.handle(ProcEvent(EventKind.EXIT, 100))
    assert 100 not in cache and cache.processes() == {}
    assert cache.identity(100) is None
    assert changes == [
        ProcessChange(True, ProcessIdentity(100, 5000), "pod-a/ctr"),
        ProcessChange(False, ProcessIdentity(100, 5000), "pod-a/ctr"),
    ]


def test_processes_of_no_interest_are_cached_but_not_announced(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    proc.start(7, 10, None)
    cache.handle(ProcEvent(EventKind.FORK, 7))
    assert 7 in cache and cache.get(7) is None and cache.processes() == {}
    assert proc.resolved == [7]  # get() used the cached None, it did not resolve again
    cache.handle(ProcEvent(EventKind.EXIT, 7))
    assert changes == []


def test_exec_re_resolves_and_reports_a_changed_value(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    proc.start(200, 1, None)  # runc's init before it joined the container's cgroup
    cache.handle(ProcEvent(EventKind.FORK, 200))
    proc.values[200] = "pod-b/ctr"
    cache.handle(ProcEvent(EventKind.EXEC, 200))
    cache.handle(ProcEvent(EventKind.EXEC, 200))  # same value again: nothing new to say
    proc.values[200] = "pod-c/ctr"
    cache.handle(ProcEvent(EventKind.EXEC, 200))
    ident = ProcessIdentity(200, 1)
    assert changes == [
        ProcessChange(True, ident, "pod-b/ctr"),
        ProcessChange(False, ident, "pod-b/ctr"),
        ProcessChange(True, ident, "pod-c/ctr"),
    ]


def test_a_reused_pid_is_told_apart_by_start_time(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    proc.start(300, 100, "old")
    cache.handle(ProcEvent(EventKind.EXEC, 300))
    proc.exit(300)  # its exit event is lost
    proc.start(300, 900, "new")
    cache.handle(ProcEvent(EventKind.FORK, 300))
    assert cache.processes()[300].identity == ProcessIdentity(300, 900)
    assert changes == [
        ProcessChange(True, ProcessIdentity(300, 100), "old"),
        ProcessChange(False, ProcessIdentity(300, 100), "old"),
        ProcessChange(True, ProcessIdentity(300, 900), "new"),
    ]


def test_an_event_for_a_process_already_gone_is_harmless(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    cache.handle(ProcEvent(EventKind.EXEC, 404))
    cache.handle(ProcEvent(EventKind.EXIT, 404))
    assert 404 not in cache and changes == []


def test_rescan_repairs_lost_events(proc: FakeProc) -> None:
    cache, changes = make_cache(proc)
    proc.start(1, 1, None)
    proc.start(10, 50, "a")
    proc.start(11, 51, "b")
    cache.rescan()
    assert set(cache.processes()) == {10, 11}
    proc.exit(10)  # exit lost
    proc.exit(11)
    proc.start(11, 99, "b2")  # pid reused, events lost
    proc.start(12, 60, "c")  # fork lost
    proc.start(13, 61, "zombie", state="Z")
    cache.rescan()
    assert {pid: e.value for pid, e in cache.processes().items()} == {11: "b2", 12: "c"}
    assert 13 not in cache
    started = {(c.identity.pid, c.value) for c in changes if c.started}
    gone = {(c.identity.pid, c.value) for c in changes if not c.started}
    assert started == {(10, "a"), (11, "b"), (11, "b2"), (12, "c")}
    assert gone == {(10, "a"), (11, "b")}
    resolved_before = len(proc.resolved)
    cache.rescan()  # nothing changed: nothing resolved again
    assert len(proc.resolved) == resolved_before


def test_get_resolves_a_pid_no_event_told_about(proc: FakeProc) -> None:
    cache, _ = make_cache(proc)
    proc.start(55, 3, "late")
    assert cache.get(55) == "late" and 55 in cache
    assert cache.get(56) is None and 56 not in cache


class ScriptedSource:
    """Plays batches of events (or raises ProcEventsLost); sets stop when the script ends."""

    def __init__(self, script: list[list[ProcEvent] | Exception], stop: threading.Event) -> None:
        self.script, self.stop, self.closed = list(script), stop, False

    def read(self, timeout_s: float) -> list[ProcEvent]:
        if not self.script:
            self.stop.set()
            return []
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def close(self) -> None:
        self.closed = True


def test_run_follows_events_and_rescans_after_an_overflow(proc: FakeProc) -> None:
    stop = threading.Event()
    proc.start(1, 1, "init")
    proc.start(20, 7, "x")
    source = ScriptedSource(
        [[ProcEvent(EventKind.EXEC, 20)], ProcEventsLost("overflow"), [ProcEvent(EventKind.EXIT, 20)]], stop
    )
    cache, changes = make_cache(proc, clock=VirtualClock(), open_events=lambda: source)
    proc.exit(1)  # gone before the first scan
    cache.run(stop)
    assert cache.rescans == 2  # the initial scan and the one the overflow asked for
    assert source.closed and cache.mode == "stopped"
    assert [(c.started, c.identity.pid) for c in changes] == [(True, 20), (False, 20)]


def test_run_rescans_periodically(proc: FakeProc) -> None:
    stop = threading.Event()
    clock = VirtualClock()

    class TickingSource(ScriptedSource):
        def read(self, timeout_s: float) -> list[ProcEvent]:
            clock.advance(timeout_s)
            return super().read(timeout_s)

    source = TickingSource([[] for _ in range(40)], stop)
    cache, _ = make_cache(
        proc, clock=clock, open_events=lambda: source, rescan_interval_s=2.0, read_timeout_s=0.25
    )
    cache.run(stop)
    assert cache.rescans == 1 + 5  # 40 reads x 0.25 s = 10 s of virtual time, one rescan per 2 s


def test_run_scans_proc_when_the_connector_is_unavailable(proc: FakeProc) -> None:
    stop = threading.Event()

    def unavailable() -> ScriptedSource:
        raise ProcEventsUnavailable("not in the host's network namespace")

    class StopAfter(VirtualClock):
        def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
            if cache.rescans == 3:
                proc.exit(30)
            if cache.rescans == 4 and stop is not None:
                stop.set()
            return super().sleep(seconds, stop)

    proc.start(30, 5, "scanned")
    cache, changes = make_cache(proc, clock=StopAfter(), open_events=unavailable, fallback_interval_s=0.5)
    cache.run(stop)
    assert cache.rescans == 4
    assert [(c.started, c.identity.pid) for c in changes] == [(True, 30), (False, 30)]
