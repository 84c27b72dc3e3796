"""Reading a whole BPF hash map cheaply, every control period.

bcc's ``items_lookup_batch`` allocates key and value buffers for ``max_entries`` on every
call (megabytes for the tracer's bounded maps) and its rows are ctypes structs, slow to
pick apart in Python. This reader keeps small buffers, walks the map in chunks with
BPF_MAP_LOOKUP_BATCH and unpacks each chunk with ``struct`` formats that mirror the C
structs. Kernels before 5.6 lack batch operations; there it falls back to key iteration.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Any

Row = tuple[tuple[int, ...], tuple[int, ...]]  # (key fields, value fields)


class BatchReader:
    """All (key, value) rows of one bcc hash table, unpacked with the given struct formats."""

    def __init__(self, table: Any, key_format: str, value_format: str, chunk: int = 256) -> None:
        import bcc  # noqa: PLC0415  (optional dependency: only with a loaded program)

        self._lib = bcc.lib
        self._table = table
        self._key = struct.Struct(key_format)
        self._value = struct.Struct(value_format)
        for what, fmt, ctype in (("key", self._key, table.Key), ("value", self._value, table.Leaf)):
            if fmt.size != ctypes.sizeof(ctype):
                raise ValueError(
                    f"{what} format {fmt.format!r} is {fmt.size} bytes but the map's {what} is "
                    f"{ctypes.sizeof(ctype)}: the C struct changed"
                )
        self._chunk = chunk
        self._alloc()
        self._batch_supported = True

    def _alloc(self) -> None:
        self._keys = (ctypes.c_char * (self._key.size * self._chunk))()
        self._values = (ctypes.c_char * (self._value.size * self._chunk))()

    def key(self, fields: tuple[int, ...]) -> Any:
        """The map's ctypes key for unpacked ``fields`` (to delete an entry)."""
        return self._table.Key.from_buffer_copy(self._key.pack(*fields))

    def rows(self) -> list[Row]:
        if self._batch_supported:
            try:
                return self._batched()
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                self._batch_supported = False  # Linux < 5.6
        return [(self._key.unpack(bytes(k)), self._value.unpack(bytes(v))) for k, v in self._table.items()]

    def _batched(self) -> list[Row]:
        out: list[Row] = []
        cursor, next_cursor = ctypes.c_uint32(0), ctypes.c_uint32(0)
        first = True
        while True:
            count = ctypes.c_uint32(self._chunk)
            res = self._lib.bpf_lookup_batch(
                self._table.get_fd(),
                None if first else ctypes.byref(cursor),
                ctypes.byref(next_cursor),
                ctypes.byref(self._keys),
                ctypes.byref(self._values),
                ctypes.byref(count),
            )
            err = ctypes.get_errno()
            n = count.value
            out.extend(
                zip(
                    self._key.iter_unpack(self._keys.raw[: n * self._key.size]),
                    self._value.iter_unpack(self._values.raw[: n * self._value.size]),
                    strict=True,
                )
            )
            if res != 0:
                if err == errno.ENOENT:
                    return out  # the walk is complete
                if err == errno.ENOSPC and n == 0:
                    self._chunk *= 2  # one hash bucket holds more entries than a chunk
                    self._alloc()
                    continue
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH failed: {os.strerror(err)}")
            cursor.value, first = next_cursor.value, False
