"""The NVIDIA ioctl ABI constants, the generated program text, and decoding of the tracer's map rows."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from agent.platform.bpf import nvioctl as nv
from agent.platform.bpf.ioctl_stats import (
    DROP_FIELDS,
    LATENCY_SLOTS,
    OBJECT_FIELDS,
    EscapeRow,
    ObjectRow,
    ProcessKey,
    build_snapshot,
    latency_bucket_bounds_ns,
)
from agent.platform.bpf.ioctl_tracer import (
    DEFAULT_SOURCE,
    AttachMode,
    IoctlTracer,
    IoctlTracerError,
    TracerLimits,
)

C_SOURCE = DEFAULT_SOURCE.read_text()


def c_define(name: str) -> int:
    match = re.search(rf"^#define {name} (0x[0-9A-Fa-f]+|\d+)u?\b", C_SOURCE, re.MULTILINE)
    assert match, f"{name} is not #defined in {DEFAULT_SOURCE}"
    return int(match.group(1), 0)


def test_command_numbers_match_the_driver_abi() -> None:
    assert nv.RM_FREE == 0xC0104629
    assert nv.RM_CONTROL == 0xC020462A
    assert nv.RM_ALLOC_21 == 0xC020462B
    assert nv.RM_ALLOC_64_PRE535 == 0xC028462B
    assert nv.RM_ALLOC_64 == 0xC030462B
    assert (ctypes.sizeof(nv.NVOS00), ctypes.sizeof(nv.NVOS21)) == (16, 32)
    assert (ctypes.sizeof(nv.NVOS64Pre535), ctypes.sizeof(nv.NVOS64)) == (40, 48)
    assert nv.MemoryAllocationParams.size.offset == nv.MEMORY_ALLOCATION_SIZE_OFFSET == 64


def test_c_program_uses_the_same_numbers_and_offsets() -> None:
    """The BPF side decodes the structs by offset; keep it in step with the ctypes mirror."""
    assert c_define("NV_CMD_RM_FREE") == nv.RM_FREE
    assert c_define("NV_CMD_RM_ALLOC_21") == nv.RM_ALLOC_21
    assert c_define("NV_CMD_RM_ALLOC_64_OLD") == nv.RM_ALLOC_64_PRE535
    assert c_define("NV_CMD_RM_ALLOC_64") == nv.RM_ALLOC_64
    assert c_define("NV_IOCTL_MASK") == nv.NV_IOCTL_MASK
    assert c_define("NV_IOCTL_MATCH") == nv.NV_IOCTL_MATCH
    assert c_define("NVOS00_STATUS") == nv.NVOS00.status.offset
    assert c_define("NVOS21_STATUS") == nv.NVOS21.status.offset
    assert c_define("NVOS64_OLD_STATUS") == nv.NVOS64Pre535.status.offset
    assert c_define("NVOS64_STATUS") == nv.NVOS64.status.offset
    assert c_define("NVOS_HOBJECT_NEW") == nv.NVOS21.hObjectNew.offset == nv.NVOS64.hObjectNew.offset
    assert c_define("NVOS_ALLOC_PARAMS") == nv.NVOS21.pAllocParms.offset == nv.NVOS64.pAllocParms.offset
    assert c_define("NV_MEMORY_ALLOCATION_SIZE") == nv.MEMORY_ALLOCATION_SIZE_OFFSET
    assert c_define("NV01_MEMORY_LOCAL_USER") == nv.NV01_MEMORY_LOCAL_USER
    assert c_define("LATENCY_SLOTS") == LATENCY_SLOTS
    gpfifo = {int(c, 16) for c in re.findall(r"case (0x[0-9A-F]+6F):", C_SOURCE)}
    assert gpfifo == nv.GPFIFO_CLASSES


@pytest.mark.parametrize(
    ("cmd", "traced"),
    [
        (nv.RM_ALLOC_21, True),
        (nv.RM_FREE, True),
        (nv.iowr(nv.NV_IOCTL_MAGIC, 0xD2, 0x48), True),  # CHECK_VERSION_STR
        (0x4600, False),  # FBIOGET_VSCREENINFO: fbdev's plain 'F' ioctls
        (0x4602, False),
        (0x4020462B, False),  # _IOW, not _IOWR
        (0x8020462B, False),  # _IOR
        (nv.iowr(ord("G"), 0x2B, 32), False),
        (0x5401, False),  # TCGETS
        (0x30000001, False),  # UVM_INITIALIZE: plain integers are out of scope
    ],
)
def test_nvidia_command_filter(cmd: int, traced: bool) -> None:
    assert nv.is_nvidia_rm_cmd(cmd) is traced


def test_iowr_rejects_sizes_beyond_the_field() -> None:
    with pytest.raises(ValueError, match="14 bits"):
        nv.iowr(nv.NV_IOCTL_MAGIC, 0x2B, 1 << 14)


def test_escape_names() -> None:
    assert nv.escape_name(nv.escape_of(nv.RM_ALLOC_64)) == "RM_ALLOC"
    assert nv.escape_name(0x99) == "0x99"


def test_latency_buckets_cover_all_durations_without_gaps() -> None:
    assert latency_bucket_bounds_ns(0) == (0, 2)
    assert latency_bucket_bounds_ns(10) == (1024, 2048)
    assert latency_bucket_bounds_ns(LATENCY_SLOTS - 1) == (1 << (LATENCY_SLOTS - 1), None)
    for slot in range(1, LATENCY_SLOTS):
        assert latency_bucket_bounds_ns(slot)[0] == latency_bucket_bounds_ns(slot - 1)[1]
    with pytest.raises(ValueError):
        latency_bucket_bounds_ns(LATENCY_SLOTS)


def escape(key: tuple[int, int, int], calls: int, errors: int, latency: dict[int, int]) -> EscapeRow:
    slots = [0] * LATENCY_SLOTS
    for slot, count in latency.items():
        slots[slot] = count
    return EscapeRow(*key, calls, errors, slots)


def test_snapshot_sums_escapes_per_process_and_joins_objects() -> None:
    escapes = [
        escape((7, 100, 0x2B), 26, 26, {5: 20, 12: 6}),
        escape((7, 100, 0x29), 4, 1, {12: 4}),
        escape((8, 200, 0x2A), 2, 0, {3: 2}),
    ]
    objects = [
        ObjectRow(7, 100, [23, 5, 10_000, 1_000, 3, 1]),
        ObjectRow(9, 300, [1, 0, 4096, 0, 0, 0]),  # its escape entry was not stored (map full)
    ]
    snap = build_snapshot(escapes, objects, [1, 2, 0, 3])
    assert set(snap.processes) == {ProcessKey(7, 100), ProcessKey(8, 200), ProcessKey(9, 300)}
    first = snap.processes[ProcessKey(7, 100)]
    assert (first.calls, first.errors) == (30, 27)
    assert first.calls_by_escape == {0x29: 4, 0x2B: 26}
    assert (first.vidmem_allocs, first.vidmem_frees, first.vidmem_objects) == (23, 5, 18)
    assert first.vidmem_bytes == 9_000
    assert (first.channels_created, first.channels_freed, first.channels) == (3, 1, 2)
    assert sum(first.latency_log2_ns) == first.calls
    assert (first.latency_log2_ns[5], first.latency_log2_ns[12]) == (20, 10)
    assert first.key == ProcessKey(7, 100)
    second = snap.processes[ProcessKey(8, 200)]
    assert (second.calls, second.vidmem_bytes, second.channels) == (2, 0, 0)
    third = snap.processes[ProcessKey(9, 300)]
    assert (third.calls, third.calls_by_escape, third.vidmem_bytes) == (0, {}, 4096)
    assert snap.for_cgroup(8) == [second]
    assert snap.for_pid(100) == [first]
    assert snap.for_cgroup(10) == []
    assert (snap.drops.inflight, snap.drops.escapes, snap.drops.procs, snap.drops.objects) == (1, 2, 0, 3)
    assert snap.drops.total == 6


def test_snapshot_rejects_rows_of_another_layout() -> None:
    with pytest.raises(ValueError, match="latency slots"):
        build_snapshot([EscapeRow(1, 2, 0x2A, 1, 0, [1] * (LATENCY_SLOTS - 1))], [], [0] * 4)
    with pytest.raises(ValueError, match="counters"):
        build_snapshot([], [ObjectRow(1, 2, [0] * (len(OBJECT_FIELDS) + 1))], [0] * 4)
    with pytest.raises(ValueError, match="drops"):
        build_snapshot([], [], [0] * (len(DROP_FIELDS) + 1))


def test_generated_source_is_the_template_behind_its_defines() -> None:
    limits = TracerLimits(procs=128, escapes=256, objects=512, inflight=64)
    tracer = IoctlTracer(limits=limits)
    text = tracer.source()
    assert text.endswith(C_SOURCE)
    head = text[: -len(C_SOURCE)]
    assert "#define VCUDA_ATTACH_KPROBE 0" in head
    assert "#define VCUDA_TASK_STORAGE 1" in head
    assert "syscalls:sys_enter_ioctl" in head
    for name, value in limits.defines().items():
        assert f"#define {name} {value}\n" in head


def test_kprobe_source_names_the_driver_function() -> None:
    tracer = IoctlTracer(mode=AttachMode.KPROBE, kprobe_function="nvidia_frontend_unlocked_ioctl")
    text = tracer.source()
    assert "#define VCUDA_ATTACH_KPROBE 1" in text
    assert "kprobe/kretprobe on nvidia_frontend_unlocked_ioctl" in text
    assert "PT_REGS_PARM2(ctx)" in text  # cmd is the driver function's second argument


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    tracer = IoctlTracer(source_path=tmp_path / "nope.c")
    with pytest.raises(IoctlTracerError, match=r"nope\.c"):
        tracer.source()


def test_reading_before_start_is_an_error() -> None:
    tracer = IoctlTracer()
    assert not tracer.running and not tracer.attached
    with pytest.raises(IoctlTracerError, match="not started"):
        tracer.snapshot()
    tracer.stop()  # idempotent when never started
