"""A BPF map held by its fd, read and written with raw bpf(2) commands (no bcc in the agent).

Keys and values are bytes exactly as the kernel stores them; callers pack and unpack them with
``struct`` formats that mirror the C structs (the sizes are checked against the map's). Only
maps whose values are one copy per key are supported (hash, array, LRU hash): per-CPU maps
return one value per possible CPU, which no caller needs.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from typing import ClassVar

from agent.platform.bpf import syscall
from agent.platform.bpf.syscall import BpfSyscallError

BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_MAP_LOOKUP_BATCH = 24
BPF_ANY = 0  # create or update


class _ElemAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("map_fd", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # next_key for BPF_MAP_GET_NEXT_KEY
        ("flags", ctypes.c_uint64),
    ]


class _BatchAttr(ctypes.Structure):
    _fields_: ClassVar = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


def _address(buf: ctypes.Array[ctypes.c_char] | None) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


class BpfMap:
    """One map: its fd (owned: :meth:`close` closes it), name and layout."""

    def __init__(
        self, fd: int, name: str, *, map_type: int, key_size: int, value_size: int, max_entries: int
    ) -> None:
        self.fd = fd
        self.name = name
        self.map_type = map_type
        self.key_size = key_size
        self.value_size = value_size
        self.max_entries = max_entries

    @classmethod
    def from_fd(cls, fd: int, name: str | None = None) -> BpfMap:
        """Layout from the kernel (BPF_OBJ_GET_INFO_BY_FD); takes ownership of ``fd``."""
        info = syscall.map_info(fd)
        return cls(
            fd,
            name or info.name,
            map_type=info.type,
            key_size=info.key_size,
            value_size=info.value_size,
            max_entries=info.max_entries,
        )

    def __len__(self) -> int:
        return self.max_entries

    def __repr__(self) -> str:
        return f"BpfMap({self.name!r}, fd={self.fd}, key={self.key_size}B, value={self.value_size}B)"

    def _key(self, key: bytes) -> ctypes.Array[ctypes.c_char]:
        if len(key) != self.key_size:
            raise ValueError(f"map {self.name}: key of {len(key)} bytes, the map's are {self.key_size}")
        return ctypes.create_string_buffer(key, self.key_size)

    def _call(self, cmd: int, attr: ctypes.Structure, what: str) -> None:
        result, err = syscall.call_errno(cmd, attr)
        if result < 0:  # the message is built on failure only: reads run every period
            raise BpfSyscallError(f"{what} in BPF map {self.name}", err)

    def _elem(
        self, cmd: int, key: ctypes.Array[ctypes.c_char] | None, value: int, what: str, flags: int = 0
    ) -> None:
        self._call(cmd, _ElemAttr(map_fd=self.fd, key=_address(key), value=value, flags=flags), what)

    def lookup(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None."""
        value = ctypes.create_string_buffer(self.value_size)
        try:
            self._elem(BPF_MAP_LOOKUP_ELEM, self._key(key), ctypes.addressof(value), "looking up a key")
        except BpfSyscallError as err:
            if err.errno == errno.ENOENT:
                return None
            raise
        return value.raw

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        if len(value) != self.value_size:
            raise ValueError(f"map {self.name}: value of {len(value)} bytes, the map's are {self.value_size}")
        buf = ctypes.create_string_buffer(value, self.value_size)
        self._elem(BPF_MAP_UPDATE_ELEM, self._key(key), ctypes.addressof(buf), "storing a key", flags)

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False when it was not there."""
        try:
            self._elem(BPF_MAP_DELETE_ELEM, self._key(key), 0, "deleting a key")
        except BpfSyscallError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def keys(self) -> Iterator[bytes]:
        """Every key, by BPF_MAP_GET_NEXT_KEY (a NULL key yields the first; Linux >= 4.12)."""
        current: ctypes.Array[ctypes.c_char] | None = None
        while True:
            following = ctypes.create_string_buffer(self.key_size)
            try:
                self._elem(BPF_MAP_GET_NEXT_KEY, current, ctypes.addressof(following), "walking the keys")
            except BpfSyscallError as err:
                if err.errno == errno.ENOENT:
                    return  # past the last key
                raise
            yield following.raw
            current = following

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def items(self) -> list[tuple[bytes, bytes]]:
        """(key, value) for every key still present when it is read."""
        found = []
        for key in list(self.keys()):
            value = self.lookup(key)
            if value is not None:  # deleted between the walk and the read
                found.append((key, value))
        return found

    def lookup_batch(
        self,
        in_batch: ctypes.Array[ctypes.c_char] | None,
        out_batch: ctypes.Array[ctypes.c_char],
        keys: ctypes.Array[ctypes.c_char],
        values: ctypes.Array[ctypes.c_char],
        count: int,
    ) -> tuple[int, bool]:
        """One BPF_MAP_LOOKUP_BATCH step (Linux >= 5.6): (rows written, whether the walk is done).

        ``in_batch`` None starts the walk; the next step passes this step's ``out_batch``."""
        attr = _BatchAttr(
            in_batch=_address(in_batch),
            out_batch=ctypes.addressof(out_batch),
            keys=ctypes.addressof(keys),
            values=ctypes.addressof(values),
            count=count,
            map_fd=self.fd,
        )
        result, err = syscall.call_errno(BPF_MAP_LOOKUP_BATCH, attr)
        if result >= 0:
            return attr.count, False
        if err == errno.ENOENT:
            return attr.count, True  # the last rows came with the end of the walk
        raise BpfSyscallError(f"batch lookup in BPF map {self.name}", err)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
