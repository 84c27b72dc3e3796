"""A pid → value cache kept fresh by the kernel's process connector (cn_proc) through pyroute2.

New processes (fork of a new thread group, exec) are resolved once with an injected
``resolve(pid)`` (e.g. pid → container) and announced to subscribers; exits drop the entry
at once. A pid reused by another process is told apart by its start time
(:class:`~agent.platform.procfs.ProcessIdentity`).

cn_proc is lossy: under load the socket overflows (ENOBUFS) and events are gone, so the
cache rescans /proc when that happens and, to repair anything lost silently, every
``rescan_interval_s``. Where the connector cannot be used (kernels before 6.6 without
CAP_NET_ADMIN; any network namespace but the host's, so the agent pod needs
``hostNetwork: true``) the cache falls back to scanning /proc every ``fallback_interval_s``.
"""

from __future__ import annotations

import enum
import errno
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from agent.clock import Clock, SystemClock
from agent.errors import PlatformError, ProcessGoneError
from agent.platform.procfs import ProcessIdentity, ProcFS

log = logging.getLogger(__name__)

T = TypeVar("T")

PROC_EVENT_NONE, PROC_EVENT_FORK, PROC_EVENT_EXEC, PROC_EVENT_EXIT = 0x0, 0x1, 0x2, 0x80000000
# The answer to the listen request is a PROC_EVENT_NONE whose event data is {u32 err}: it follows
# nlmsghdr (16), cn_msg (20) and what/cpu/timestamp (16).
_ACK_ERR_OFFSET = 52
_RECV_SIZE = 65536
_MAX_DRAIN = 1024


class ProcEventsUnavailable(PlatformError):
    """The process connector cannot be used here; the cache scans /proc instead."""


class ProcEventsLost(PlatformError):
    """The connector's socket overflowed: events were dropped and a rescan is needed."""


class EventKind(enum.Enum):
    """The process events the cache acts on."""

    FORK = "fork"  # a new process (thread group), not a new thread
    EXEC = "exec"
    EXIT = "exit"  # the thread-group leader exited


@dataclass(frozen=True)
class ProcEvent:
    """One process-level event from cn_proc."""

    kind: EventKind
    pid: int  # the tgid


_NLMSG_LEN = struct.Struct("=I")
_NLMSG_HDR = 16
_WHAT_OFFSET = _NLMSG_HDR + 20  # after nlmsghdr and cn_msg
_EVENT_IDS = struct.Struct("=II")  # fork: parent pid/tgid, then child; exec/exit: process pid/tgid
_FORK_CHILD_OFFSET = _ACK_ERR_OFFSET + 8


def events_from_datagram(data: bytes) -> list[ProcEvent]:
    """Process-level events out of one raw cn_proc datagram; thread events are dropped.

    Decoded with struct rather than pyroute2's parser: every thread start, exit and rename on
    the host arrives here, and pyroute2's generic decoder cost ~1 ms of GIL time per event,
    which under a busy node starved the agent's gRPC threads (docs/benchmarks.md)."""
    events = []
    offset = 0
    while offset + _ACK_ERR_OFFSET + 8 <= len(data):
        (length,) = _NLMSG_LEN.unpack_from(data, offset)
        if length < _NLMSG_HDR or offset + length > len(data):  # the datagram holds it in part only
            break
        if length >= _ACK_ERR_OFFSET + 16:
            (what,) = _NLMSG_LEN.unpack_from(data, offset + _WHAT_OFFSET)
            if what == PROC_EVENT_FORK:
                pid, tgid = _EVENT_IDS.unpack_from(data, offset + _FORK_CHILD_OFFSET)
                if pid == tgid:
                    events.append(ProcEvent(EventKind.FORK, tgid))
            elif what in (PROC_EVENT_EXEC, PROC_EVENT_EXIT):
                pid, tgid = _EVENT_IDS.unpack_from(data, offset + _ACK_ERR_OFFSET)
                if what == PROC_EVENT_EXEC:
                    events.append(ProcEvent(EventKind.EXEC, tgid))
                elif pid == tgid:
                    events.append(ProcEvent(EventKind.EXIT, tgid))
        offset += (length + 3) & ~3
    return events


def listen_error(answer: Iterable[Any]) -> int:
    """The errno in the kernel's answer to a listen request (0: subscribed)."""
    for msg in answer:
        if msg["what"] == PROC_EVENT_NONE:
            raw = bytes(msg.data[msg.offset : msg.offset + _ACK_ERR_OFFSET + 4])
            if len(raw) == _ACK_ERR_OFFSET + 4:
                return int(struct.unpack_from("=I", raw, _ACK_ERR_OFFSET)[0])
    return 0


class EventSource(Protocol):
    """Where process events come from (cn_proc, or a script in tests)."""

    def read(self, timeout_s: float) -> list[ProcEvent]:
        """Events that arrive within ``timeout_s`` ([] on timeout); ProcEventsLost on overflow."""
        ...

    def close(self) -> None: ...


class ProcEventSource:
    """cn_proc through pyroute2's ProcEventSocket: subscribe, then read with a timeout."""

    def __init__(self) -> None:
        from pyroute2 import ProcEventSocket  # noqa: PLC0415  (starts nothing, but is slow to import)

        try:
            self._sock = ProcEventSocket()
        except OSError as err:
            raise ProcEventsUnavailable(f"cannot open a process-connector socket: {err}") from err
        try:
            self._sock.bind()
            answer = self._sock.control(listen=True)
        except OSError as err:
            self._sock.close()
            raise ProcEventsUnavailable(
                f"cannot subscribe to process events ({err}); the connector only works in the host's "
                "network namespace (hostNetwork: true)"
            ) from err
        self._overflowed = False
        failure = listen_error(answer)
        if failure:
            self._sock.close()
            raise ProcEventsUnavailable(
                f"the kernel refused the process-event subscription: {errno.errorcode.get(failure, failure)} "
                "(before Linux 6.6 it needs CAP_NET_ADMIN)"
            )

    def read(self, timeout_s: float) -> list[ProcEvent]:
        if self._overflowed:
            self._overflowed = False
            raise ProcEventsLost("the process-event socket overflowed; events were lost")
        if not select.select([self._sock.fileno()], [], [], timeout_s)[0]:
            return []
        events: list[ProcEvent] = []
        for _ in range(_MAX_DRAIN):  # one datagram per event; bounded so a fork storm cannot hold us
            try:
                data = self._sock.recv(_RECV_SIZE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    raise PlatformError(f"reading process events failed: {err}") from err
                self._overflowed = True  # hand over what was read; report the loss next time
                break
            events.extend(events_from_datagram(data))
        return events

    def close(self) -> None:
        self._sock.close()


@dataclass(frozen=True)
class CachedProcess(Generic[T]):
    """A live process and what the resolver said about it."""

    identity: ProcessIdentity
    value: T | None  # None: resolved, but not of interest (e.g. not in a container)


@dataclass(frozen=True)
class ProcessChange(Generic[T]):
    """What subscribers hear: a process of interest started (or changed value on exec), or is gone."""

    started: bool
    identity: ProcessIdentity
    value: T


class ProcessCache(Generic[T]):
    """pid → resolved value for every live process, kept fresh by process events (or /proc scans)."""

    def __init__(
        self,
        resolve: Callable[[int], T | None],
        *,
        procfs: ProcFS | None = None,
        clock: Clock | None = None,
        open_events: Callable[[], EventSource] = ProcEventSource,
        rescan_interval_s: float = 30.0,
        fallback_interval_s: float = 1.0,
        read_timeout_s: float = 0.2,
    ) -> None:
        self._resolve = resolve
        self._procfs = procfs or ProcFS()
        self._clock = clock or SystemClock()
        self._open_events = open_events
        self.rescan_interval_s = rescan_interval_s
        self.fallback_interval_s = fallback_interval_s
        self.read_timeout_s = read_timeout_s
        self._entries: dict[int, CachedProcess[T]] = {}
        self._subscribers: list[Callable[[ProcessChange[T]], None]] = []
        self._lock = threading.Lock()
        self.mode = "stopped"  # "events" | "scan" while run() runs
        self.rescans = 0

    # -- reading ------------------------------------------------------------------------------

    def get(self, pid: int) -> T | None:
        """The value of ``pid``, resolving it now when no event told about it yet."""
        with self._lock:
            entry = self._entries.get(pid)
        if entry is None:
            entry = self._learn(pid)
        return entry.value if entry is not None else None

    def identity(self, pid: int) -> ProcessIdentity | None:
        """The identity the cache holds for ``pid`` (kept current by exit events), or None."""
        with self._lock:
            entry = self._entries.get(pid)
        return entry.identity if entry is not None else None

    def processes(self) -> dict[int, CachedProcess[T]]:
        """Live processes whose value is not None."""
        with self._lock:
            return {pid: e for pid, e in self._entries.items() if e.value is not None}

    def __contains__(self, pid: object) -> bool:
        with self._lock:
            return pid in self._entries

    def subscribe(self, callback: Callable[[ProcessChange[T]], None]) -> None:
        """Called on every change, from the thread that saw it (the loop or a get() caller); keep it short."""
        self._subscribers.append(callback)

    # -- updating -----------------------------------------------------------------------------

    def handle(self, event: ProcEvent) -> None:
        if event.kind is EventKind.EXIT:
            self._drop(event.pid)
        else:  # exec re-resolves: the process may have moved (runc's init joins its cgroup, then execs)
            self._learn(event.pid, refresh=event.kind is EventKind.EXEC)

    def rescan(self) -> None:
        """Reconcile with /proc: drop what is gone or reused, learn what is new."""
        self.rescans += 1
        try:
            live = {int(entry.name) for entry in self._procfs.root.iterdir() if entry.name.isdigit()}
        except OSError as err:
            raise PlatformError(f"cannot list {self._procfs.root}: {err}") from err
        with self._lock:
            known = dict(self._entries)
        for pid, cached in known.items():
            if pid not in live:
                self._drop(pid, cached.identity)
        for pid in sorted(live):
            self._learn(pid)  # a known pid costs one read of its stat (reuse check)

    def _learn(self, pid: int, *, refresh: bool = False) -> CachedProcess[T] | None:
        try:
            stat = self._procfs.stat(pid)
            if stat.state in ("Z", "X"):
                raise ProcessGoneError(f"process {pid} has exited")
            with self._lock:
                old = self._entries.get(pid)
            if not refresh and old is not None and old.identity == stat.identity:
                return old
            entry = CachedProcess(stat.identity, self._resolve(pid))
        except ProcessGoneError:
            self._drop(pid)
            return None
        with self._lock:
            self._entries[pid] = entry
        changed = old is None or (old.identity, old.value) != (entry.identity, entry.value)
        if changed and old is not None and old.value is not None:
            self._notify(ProcessChange(False, old.identity, old.value))
        if changed and entry.value is not None:
            self._notify(ProcessChange(True, entry.identity, entry.value))
        return entry

    def _drop(self, pid: int, identity: ProcessIdentity | None = None) -> None:
        with self._lock:
            entry = self._entries.get(pid)
            if entry is None or (identity is not None and entry.identity != identity):
                return
            del self._entries[pid]
        if entry.value is not None:
            self._notify(ProcessChange(False, entry.identity, entry.value))

    def _notify(self, change: ProcessChange[T]) -> None:
        for callback in list(self._subscribers):
            callback(change)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Follow process events until ``stop`` is set (a supervised task)."""
        try:
            source: EventSource | None = self._open_events()
        except ProcEventsUnavailable as err:
            log.warning(
                "process events unavailable (%s); scanning /proc every %.1f s", err, self.fallback_interval_s
            )
            source = None
        self.mode = "events" if source is not None else "scan"
        try:
            self.rescan()  # after subscribing, so nothing falls between the scan and the events
            next_rescan = self._clock.monotonic() + self.rescan_interval_s
            while not stop.is_set():
                if source is None:
                    if self._clock.sleep(self.fallback_interval_s, stop):
                        break
                    self.rescan()
                    continue
                try:
                    for event in source.read(self.read_timeout_s):
                        self.handle(event)
                except ProcEventsLost as err:
                    log.warning("%s; rescanning /proc", err)
                    next_rescan = self._clock.monotonic()
                if self._clock.monotonic() >= next_rescan:
                    self.rescan()
                    next_rescan = self._clock.monotonic() + self.rescan_interval_s
        finally:
            self.mode = "stopped"
            if source is not None:
                source.close()
