"""Bytes from the kernel: cn_proc netlink datagrams, BPF map rows (ioctl tracer, memory quotas)
and /proc/<pid>/stat. The kernel is trusted, but a truncated receive, a C struct that changed
under the agent, or a process name with any bytes must not take a control loop down.

Property: decoding returns well-typed records (or the module's own error, for /proc) and
never raises anything else; where the bytes are well-formed, the decoder gets them right.
"""

from __future__ import annotations

import ctypes
import errno
import struct
from dataclasses import dataclass
from typing import Any, cast

from hypothesis import example, given
from hypothesis import strategies as st

from agent.errors import PlatformError
from agent.platform.bpf.ioctl_stats import DROP_FIELDS, LATENCY_SLOTS
from agent.platform.bpf.ioctl_tracer import DROPS_MAP, MAP_FORMATS, IoctlTracer
from agent.platform.bpf.lsm import QUOTA_KEY, QUOTA_MAP, QUOTA_VALUE, MemoryDenyProgram
from agent.platform.bpf.mapread import BatchReader
from agent.platform.bpf.syscall import BpfSyscallError
from agent.platform.procevents import (
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    EventKind,
    ProcEvent,
    events_from_datagram,
)
from agent.platform.procfs import parse_stat
from tests.fuzz.strategies import raw_bytes
from tests.fuzz.tally import count

# -- cn_proc ------------------------------------------------------------------------------------

U32 = st.integers(0, 2**32 - 1)
WHATS = st.sampled_from([PROC_EVENT_FORK, PROC_EVENT_EXEC, PROC_EVENT_EXIT, 0, 0x200, 0x40000000]) | U32


def message(what: int, ids: tuple[int, ...]) -> bytes:
    """nlmsghdr + cn_msg + proc_event, as the kernel lays them out (see test_procevents_cache)."""
    data = struct.pack("=IIQ", what, 0, 123) + struct.pack(f"={len(ids)}I", *ids)
    data += bytes(-len(data) % 4 + 8)
    cn_msg = struct.pack("=IIIIHH", 1, 1, 0, 0, len(data), 0)
    return struct.pack("=IHHII", 16 + 20 + len(data), 3, 0, 0, 0) + cn_msg + data


def expected(what: int, ids: tuple[int, ...]) -> list[ProcEvent]:
    if what == PROC_EVENT_FORK and ids[2] == ids[3]:
        return [ProcEvent(EventKind.FORK, ids[3])]
    if what == PROC_EVENT_EXEC:
        return [ProcEvent(EventKind.EXEC, ids[1])]
    if what == PROC_EVENT_EXIT and ids[0] == ids[1]:
        return [ProcEvent(EventKind.EXIT, ids[1])]
    return []


small_pids = st.integers(1, 5)  # few values, so pid == tgid (process, not thread) happens often
events = st.tuples(
    WHATS, st.tuples(small_pids, small_pids, small_pids, small_pids) | st.tuples(U32, U32, U32, U32)
)


def decoded(data: bytes) -> list[ProcEvent]:
    count("procevents")
    found = events_from_datagram(data)
    assert all(isinstance(e.kind, EventKind) and 0 <= e.pid < 2**32 for e in found)
    return found


@given(batch=st.lists(events, max_size=6))
def test_well_formed_datagrams(batch: list[tuple[int, tuple[int, ...]]]) -> None:
    data = b"".join(message(what, ids) for what, ids in batch)
    assert decoded(data) == [e for what, ids in batch for e in expected(what, ids)]


@given(batch=st.lists(events, min_size=1, max_size=4), cut=st.integers(0, 400), junk=raw_bytes)
@example(batch=[(PROC_EVENT_FORK, (1, 1, 2, 2))], cut=12, junk=b"")  # the fork's child ids cut off
def test_cut_and_corrupted_datagrams(batch: list[tuple[int, tuple[int, ...]]], cut: int, junk: bytes) -> None:
    data = b"".join(message(what, ids) for what, ids in batch)
    decoded(data[: max(0, len(data) - cut)])  # a receive cut short
    decoded(data[: len(data) // 2] + junk)  # garbage after a whole message


@given(data=raw_bytes | st.binary(min_size=60, max_size=80))
def test_random_datagrams(data: bytes) -> None:
    decoded(data)


# -- BPF maps -----------------------------------------------------------------------------------


@dataclass
class FakeMap:
    """A BPF hash map as bpf(2) returns it: keys and values of the map's sizes with any content,
    walked in batches (or key by key where the kernel has no batch operations)."""

    key_size: int
    value_size: int
    rows: list[tuple[bytes, bytes]]
    batch: bool = True
    bucket: int = 1  # a hash bucket this big needs a chunk at least as big (ENOSPC otherwise)
    name: str = "fake"

    def items(self) -> list[tuple[bytes, bytes]]:
        return list(self.rows)

    def lookup_batch(
        self,
        in_batch: ctypes.Array[ctypes.c_char] | None,
        out_batch: ctypes.Array[ctypes.c_char],
        keys: ctypes.Array[ctypes.c_char],
        values: ctypes.Array[ctypes.c_char],
        count: int,
    ) -> tuple[int, bool]:
        if not self.batch:
            raise BpfSyscallError("batch lookup", errno.EINVAL)
        if count < self.bucket:
            raise BpfSyscallError("batch lookup", errno.ENOSPC)
        start = 0 if in_batch is None else int.from_bytes(in_batch.raw[:4], "little")
        chunk = self.rows[start : start + count]
        ctypes.memmove(keys, b"".join(k for k, _ in chunk), len(chunk) * self.key_size)
        ctypes.memmove(values, b"".join(v for _, v in chunk), len(chunk) * self.value_size)
        ctypes.memmove(out_batch, (start + len(chunk)).to_bytes(4, "little"), 4)
        return len(chunk), start + len(chunk) >= len(self.rows)


@st.composite
def fake_maps(draw: st.DrawFn, key_format: str, value_format: str, max_rows: int = 12) -> FakeMap:
    sizes = struct.calcsize(key_format), struct.calcsize(value_format)
    rows = draw(
        st.lists(
            st.tuples(
                st.binary(min_size=sizes[0], max_size=sizes[0]),
                st.binary(min_size=sizes[1], max_size=sizes[1]),
            ),
            max_size=max_rows,
        )
    )
    return FakeMap(*sizes, rows, batch=draw(st.booleans()), bucket=draw(st.sampled_from([1, 1, 300])))


def reader(table: FakeMap, key_format: str, value_format: str, chunk: int = 4) -> BatchReader:
    return BatchReader(cast(Any, table), key_format, value_format, chunk=chunk)


@given(
    escapes=fake_maps(*MAP_FORMATS[b"escape_stats"]),
    objects=fake_maps(*MAP_FORMATS[b"proc_objects"]),
    drops=st.lists(st.integers(0, 2**64 - 1), min_size=len(DROP_FIELDS), max_size=len(DROP_FIELDS)),
)
def test_ioctl_tracer_snapshot(escapes: FakeMap, objects: FakeMap, drops: list[int]) -> None:
    count("bpf.ioctl-maps")
    tracer = IoctlTracer()
    tracer._bpf = cast(Any, object())  # loaded: the readers below are its maps
    drops_map = FakeMap(4, 8, [(struct.pack("=I", i), struct.pack("=Q", n)) for i, n in enumerate(drops)])
    tracer._readers = {
        b"escape_stats": reader(escapes, *MAP_FORMATS[b"escape_stats"]),
        b"proc_objects": reader(objects, *MAP_FORMATS[b"proc_objects"]),
        DROPS_MAP: reader(drops_map, "=I", "=Q"),
    }
    snapshot = tracer.snapshot()
    keys = {struct.unpack("=QII", k)[:2] for k, _ in escapes.rows + objects.rows}
    assert set(snapshot.processes) == keys  # one entry per (cgroup, pid) seen in either map
    for stats in snapshot.processes.values():
        assert len(stats.latency_log2_ns) == LATENCY_SLOTS
        assert all(isinstance(v, int) and v >= 0 for v in (stats.calls, stats.errors, stats.vidmem_allocs))
    assert snapshot.drops.total == sum(drops)


@given(table=fake_maps(QUOTA_KEY.format, QUOTA_VALUE.format))
def test_memory_quota_map(table: FakeMap) -> None:
    count("bpf.quota-map")
    program = MemoryDenyProgram()
    program._bpf = cast(Any, {QUOTA_MAP: table})  # loaded: its map is the fake
    quotas = program.quotas()
    assert set(quotas) == {QUOTA_KEY.unpack(k)[0] for k, _ in table.rows}
    assert all(0 <= q < 2**64 and 0 <= u < 2**64 for q, u in quotas.values())


# -- /proc/<pid>/stat ---------------------------------------------------------------------------

stat_lines = st.builds(
    lambda pid, comm, fields: f"{pid} ({comm}) {' '.join(fields)}",
    st.integers(0, 2**22),
    st.text(max_size=20),  # comm: any bytes, decoded with errors="replace", may hold ") ("
    st.lists(
        st.sampled_from(["S", "Z", "0", "1", "-1", "²", "18446744073709551615", ""]) | st.text(max_size=4),
        max_size=25,
    ),
)


@given(text=stat_lines | st.text(max_size=200))
@example(text="1 (a) S " + "²" * 20)  # isdigit()-style digits int() refuses
def test_proc_stat(text: str) -> None:
    count("procfs.stat")
    try:
        stat = parse_stat(42, text)
    except PlatformError as err:
        assert "/proc/42/stat" in str(err)
        return
    assert isinstance(stat.state, str) and stat.start_ticks == int(stat.start_ticks)
