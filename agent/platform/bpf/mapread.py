"""Reading a whole BPF hash map cheaply, every control period.

The reader keeps small key and value buffers, walks the map in chunks with
BPF_MAP_LOOKUP_BATCH and unpacks each chunk with ``struct`` formats that mirror the C structs
(a size mismatch with the map fails at construction). Kernels before 5.6 lack batch
operations; there it falls back to key iteration.
"""

from __future__ import annotations

import ctypes
import errno
import struct

from agent.platform.bpf.maps import BpfMap
from agent.platform.bpf.syscall import BpfSyscallError

Row = tuple[tuple[int, ...], tuple[int, ...]]  # (key fields, value fields)
_CURSOR_BYTES = 8  # hash maps use a u32 bucket cursor; room for more costs nothing


class BatchReader:
    """All (key, value) rows of one hash map, unpacked with the given struct formats."""

    def __init__(self, table: BpfMap, key_format: str, value_format: str, chunk: int = 256) -> None:
        self._table = table
        self._key = struct.Struct(key_format)
        self._value = struct.Struct(value_format)
        for what, fmt, size in (("key", self._key, table.key_size), ("value", self._value, table.value_size)):
            if fmt.size != size:
                raise ValueError(
                    f"{what} format {fmt.format!r} is {fmt.size} bytes but the map's {what} is "
                    f"{size}: the C struct changed"
                )
        self._chunk = chunk
        self._alloc()
        self._batch_supported = True

    def _alloc(self) -> None:
        self._keys = (ctypes.c_char * (self._key.size * self._chunk))()
        self._values = (ctypes.c_char * (self._value.size * self._chunk))()
        self._cursor = ctypes.create_string_buffer(_CURSOR_BYTES)
        self._next_cursor = ctypes.create_string_buffer(_CURSOR_BYTES)

    def key(self, fields: tuple[int, ...]) -> bytes:
        """The map's key for unpacked ``fields`` (to delete an entry)."""
        return self._key.pack(*fields)

    def rows(self) -> list[Row]:
        if self._batch_supported:
            try:
                return self._batched()
            except BpfSyscallError as err:
                if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                self._batch_supported = False  # Linux < 5.6
        return [(self._key.unpack(k), self._value.unpack(v)) for k, v in self._table.items()]

    def _batched(self) -> list[Row]:
        out: list[Row] = []
        first = True
        while True:
            try:
                n, done = self._table.lookup_batch(
                    None if first else self._cursor, self._next_cursor, self._keys, self._values, self._chunk
                )
            except BpfSyscallError as err:
                if err.errno == errno.ENOSPC:
                    self._chunk *= 2  # one hash bucket holds more entries than a chunk
                    self._alloc()
                    continue
                raise
            out.extend(
                zip(
                    self._key.iter_unpack(self._keys.raw[: n * self._key.size]),
                    self._value.iter_unpack(self._values.raw[: n * self._value.size]),
                    strict=True,
                )
            )
            if done:
                return out  # the walk is complete
            ctypes.memmove(self._cursor, self._next_cursor, _CURSOR_BYTES)
            first = False
