"""bpf(2) commands the agent process issues itself, through ctypes (it never imports bcc).

Attaching, detaching and listing the programs on a cgroup (BPF_PROG_ATTACH, _DETACH,
_QUERY), naming a program or map by fd or id (BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD),
and attaching LSM programs (BPF_RAW_TRACEPOINT_OPEN). Map element commands live in
:mod:`agent.platform.bpf.maps`, on top of :func:`call`. The argument structs mirror
``union bpf_attr`` in include/uapi/linux/bpf.h; the kernel accepts a shorter union than its
own as long as the fields we leave out are zero. Failures raise ``BpfSyscallError`` with the errno.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from typing import ClassVar

from agent.errors import PlatformError

# bpf(2)'s number differs per architecture (it has no libc wrapper).
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}

BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_RAW_TRACEPOINT_OPEN = 17

BPF_CGROUP_DEVICE = 6  # enum bpf_attach_type
BPF_PROG_TYPE_CGROUP_DEVICE = 15  # enum bpf_prog_type
BPF_F_ALLOW_OVERRIDE = 1
BPF_F_ALLOW_MULTI = 2
BPF_OBJ_NAME_LEN = 16


class BpfSyscallError(PlatformError):
    """A bpf(2) command failed; ``errno`` says why."""

    def __init__(self, what: str, errno: int) -> None:
        self.errno = errno
        super().__init__(f"{what}: {os.strerror(errno)} (errno {errno})")


class _AttachAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("target_fd", ctypes.c_uint32),
        ("attach_bpf_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
        ("replace_bpf_fd", ctypes.c_uint32),
    ]


class _QueryAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("query_flags", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
        ("prog_ids", ctypes.c_uint64),
        ("prog_cnt", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("prog_attach_flags", ctypes.c_uint64),
    ]


class _GetFdAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("prog_id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("open_flags", ctypes.c_uint32),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _ProgInfo(ctypes.Structure):
    """The head of ``struct bpf_prog_info``, up to and including ``name``."""

    _fields_: ClassVar = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
    ]


class _MapInfo(ctypes.Structure):
    """The head of ``struct bpf_map_info``, up to and including ``name``."""

    _fields_: ClassVar = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
    ]


class _RawTracepointAttr(ctypes.Structure):
    _fields_: ClassVar = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


@dataclass(frozen=True)
class MapInfo:
    id: int
    type: int
    key_size: int
    value_size: int
    max_entries: int
    name: str


@dataclass(frozen=True)
class ProgInfo:
    id: int
    type: int
    name: str


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # loaded on first use: no work at import time


def call(cmd: int, attr: ctypes.Structure, what: str) -> int:
    """bpf(cmd, &attr, sizeof attr); raises BpfSyscallError naming ``what`` on failure."""
    return _bpf(cmd, attr, what)


@functools.cache
def _sys_bpf() -> ctypes.c_long:
    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise PlatformError(f"bpf(2): no syscall number known for {platform.machine()}")
    return ctypes.c_long(number)


def call_errno(cmd: int, attr: ctypes.Structure) -> tuple[int, int]:
    """bpf(cmd, &attr, sizeof attr) without raising: (result, errno); errno is 0 on success.

    For the per-period map walks, whose normal end is an error (ENOENT)."""
    # The syscall number and libc are looked up once: map reads run every control period.
    result: int = _libc().syscall(
        _sys_bpf(), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))
    )
    return (result, ctypes.get_errno()) if result < 0 else (result, 0)


def _bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    result, errno = call_errno(cmd, attr)
    if result < 0:
        raise BpfSyscallError(what, errno)
    return result


def prog_attach(prog_fd: int, target_fd: int, attach_type: int, flags: int = 0) -> None:
    attr = _AttachAttr(
        target_fd=target_fd, attach_bpf_fd=prog_fd, attach_type=attach_type, attach_flags=flags
    )
    _bpf(BPF_PROG_ATTACH, attr, f"attaching BPF program fd {prog_fd} (type {attach_type})")


def prog_detach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    attr = _AttachAttr(target_fd=target_fd, attach_bpf_fd=prog_fd, attach_type=attach_type)
    _bpf(BPF_PROG_DETACH, attr, f"detaching BPF program fd {prog_fd} (type {attach_type})")


def prog_query(target_fd: int, attach_type: int, capacity: int = 64) -> list[int]:
    """Ids of the programs attached to ``target_fd`` (a cgroup dir fd) for ``attach_type``."""
    ids = (ctypes.c_uint32 * capacity)()
    attr = _QueryAttr(
        target_fd=target_fd, attach_type=attach_type, prog_ids=ctypes.addressof(ids), prog_cnt=capacity
    )
    _bpf(BPF_PROG_QUERY, attr, f"listing BPF programs (type {attach_type})")
    return list(ids[: min(attr.prog_cnt, capacity)])


def prog_fd_by_id(prog_id: int) -> int:
    """A new fd for a loaded program; the caller closes it."""
    return _bpf(BPF_PROG_GET_FD_BY_ID, _GetFdAttr(prog_id=prog_id), f"opening BPF program id {prog_id}")


def prog_info(prog_fd: int) -> ProgInfo:
    info = _ProgInfo()
    attr = _InfoAttr(bpf_fd=prog_fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, f"reading info of BPF program fd {prog_fd}")
    return ProgInfo(id=info.id, type=info.type, name=info.name.decode(errors="replace"))


def map_info(map_fd: int) -> MapInfo:
    info = _MapInfo()
    attr = _InfoAttr(bpf_fd=map_fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, f"reading info of BPF map fd {map_fd}")
    return MapInfo(
        id=info.id,
        type=info.type,
        key_size=info.key_size,
        value_size=info.value_size,
        max_entries=info.max_entries,
        name=info.name.decode(errors="replace"),
    )


def raw_tracepoint_open(prog_fd: int, name: str | None = None) -> int:
    """Attach a raw tracepoint, tracing or LSM program; returns the link fd (close it to detach).

    LSM and fentry programs name their hook at load time, so ``name`` stays None for them."""
    buf = ctypes.create_string_buffer(name.encode()) if name else None
    attr = _RawTracepointAttr(name=ctypes.addressof(buf) if buf is not None else 0, prog_fd=prog_fd)
    return _bpf(
        BPF_RAW_TRACEPOINT_OPEN, attr, f"attaching BPF program fd {prog_fd} ({name or 'its BTF hook'})"
    )


def prog_info_by_id(prog_id: int) -> ProgInfo:
    fd = prog_fd_by_id(prog_id)
    try:
        return prog_info(fd)
    finally:
        os.close(fd)


def detach_by_id(target_fd: int, attach_type: int, prog_id: int) -> None:
    """Detach one attached program, named by id (what runc does to programs it did not load)."""
    fd = prog_fd_by_id(prog_id)
    try:
        prog_detach(fd, target_fd, attach_type)
    finally:
        os.close(fd)
