"""Attaching loaded tracing programs through perf events, with raw syscalls (no bcc in the agent).

A tracepoint is a PERF_TYPE_TRACEPOINT event (config: the id under tracefs
events/<category>/<name>/id); a kprobe or kretprobe is an event of the kprobe PMU (type in
/sys/bus/event_source/devices/kprobe/type, config1 the function name, the return-probe bit
from .../format/retprobe), as libbpf and bcc create them. The program is set on the event
with PERF_EVENT_IOC_SET_BPF and the event enabled; closing the returned fd detaches it.

One event per attach point is enough: tracing events run their BPF program on every CPU, so
bcc and libbpf open them with pid -1 on CPU 0, and so do we. Kretprobes made this way have
the kernel's default number of concurrent instances (the PMU takes no ``maxactive``).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import platform
from pathlib import Path
from typing import ClassVar

from agent.errors import PlatformError

_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "ppc64le": 319, "s390x": 331}
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400  # _IO('$', 0)
PERF_EVENT_IOC_SET_BPF = 0x40042408  # _IOW('$', 8, __u32)
PERF_ATTR_SIZE_VER5 = 112
TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
KPROBE_PMU = Path("/sys/bus/event_source/devices/kprobe")


class PerfAttachError(PlatformError):
    """A perf event could not be created or given the program; ``errno`` says why (0: not a syscall)."""

    def __init__(self, message: str, errno: int = 0) -> None:
        self.errno = errno
        super().__init__(message)


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` up to PERF_ATTR_SIZE_VER5 (the fields a probe event needs)."""

    _fields_: ClassVar = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),  # the bitfield (disabled, inherit, ...): all zero here
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # kprobe_func: address of the function name
        ("config2", ctypes.c_uint64),  # probe_offset
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("_reserved", ctypes.c_uint16),
    ]


def tracepoint_attr(tracepoint_id: int) -> PerfEventAttr:
    """What bcc's bpf_attach_tracing_event builds: sample every hit, wake on each."""
    return PerfEventAttr(
        type=PERF_TYPE_TRACEPOINT,
        size=PERF_ATTR_SIZE_VER5,
        config=tracepoint_id,
        sample_period=1,
        wakeup_events=1,
    )


def kprobe_attr(
    pmu_type: int, retprobe_bit: int, function: ctypes.Array[ctypes.c_char], *, retprobe: bool
) -> PerfEventAttr:
    """What libbpf's perf_event_open_probe builds; ``function`` must outlive the syscall."""
    return PerfEventAttr(
        type=pmu_type,
        size=PERF_ATTR_SIZE_VER5,
        config=(1 << retprobe_bit) if retprobe else 0,
        sample_period=1,
        wakeup_events=1,
        config1=ctypes.addressof(function),
        config2=0,
    )


def tracepoint_id(category: str, name: str, roots: tuple[Path, ...] = TRACEFS_ROOTS) -> int:
    """The event id tracefs gives ``category:name``."""
    for root in roots:
        path = root / "events" / category / name / "id"
        try:
            return int(path.read_text().strip())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            raise PerfAttachError(f"cannot read the tracepoint id {path}: {err}") from err
    where = ", ".join(str(r) for r in roots)
    raise PerfAttachError(f"no tracepoint {category}:{name} under {where} (is tracefs mounted?)")


def kprobe_pmu(pmu: Path = KPROBE_PMU) -> tuple[int, int]:
    """(the kprobe PMU's perf type, the bit of config that makes a return probe)."""
    try:
        pmu_type = int((pmu / "type").read_text().strip())
        fmt = (pmu / "format" / "retprobe").read_text().strip()  # "config:0"
        bit = int(fmt.split(":", 1)[1])
    except FileNotFoundError as err:
        raise PerfAttachError(
            f"this kernel has no kprobe PMU ({pmu} is missing): kprobes unavailable"
        ) from err
    except (OSError, ValueError, IndexError) as err:
        raise PerfAttachError(f"cannot read the kprobe PMU under {pmu}: {err}") from err
    return pmu_type, bit


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def open_event(attr: PerfEventAttr, what: str) -> int:
    """perf_event_open(attr, pid -1, cpu 0, no group, CLOEXEC): a system-wide tracing event."""
    number = _SYS_PERF_EVENT_OPEN.get(platform.machine())
    if number is None:
        raise PerfAttachError(f"perf_event_open: no syscall number known for {platform.machine()}")
    fd: int = _libc().syscall(
        ctypes.c_long(number),
        ctypes.byref(attr),
        ctypes.c_int(-1),
        ctypes.c_int(0),
        ctypes.c_int(-1),
        ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise PerfAttachError(f"perf_event_open for {what}: {os.strerror(err)} (errno {err})", err)
    return fd


def attach_event(attr: PerfEventAttr, prog_fd: int, what: str) -> int:
    """Open the event, give it the program and enable it; the fd keeps it attached."""
    fd = open_event(attr, what)
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError as err:
        os.close(fd)
        raise PerfAttachError(
            f"attaching BPF program fd {prog_fd} to {what}: {err.strerror}", err.errno or 0
        ) from err
    return fd


def attach_tracepoint(prog_fd: int, category: str, name: str, roots: tuple[Path, ...] = TRACEFS_ROOTS) -> int:
    return attach_event(tracepoint_attr(tracepoint_id(category, name, roots)), prog_fd, f"{category}:{name}")


def attach_kprobe(prog_fd: int, function: str, *, retprobe: bool, pmu: Path = KPROBE_PMU) -> int:
    pmu_type, bit = kprobe_pmu(pmu)
    name = ctypes.create_string_buffer(function.encode())
    what = f"{'kretprobe' if retprobe else 'kprobe'} {function}"
    return attach_event(kprobe_attr(pmu_type, bit, name, retprobe=retprobe), prog_fd, what)
