"""inotify(7) through libc, for watching kubelet's device-plugin directory (and, with
``TreeWatch``, the kubepods cgroup tree for the device gate).

kubelet signals a restart by deleting the sockets in the directory and creating
a new kubelet.sock; an inode number alone cannot tell (it is often reused), so
the agent watches for the create and delete events themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.errors import PlatformError

IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_IGNORED = 0x00008000
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True)
class InotifyEvent:
    mask: int
    name: str

    @property
    def created(self) -> bool:
        return bool(self.mask & (IN_CREATE | IN_MOVED_TO))

    @property
    def deleted(self) -> bool:
        return bool(self.mask & (IN_DELETE | IN_MOVED_FROM))

    @property
    def watch_gone(self) -> bool:
        """The watched directory itself was deleted or moved, or events were lost."""
        return bool(self.mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class DirectoryWatch:
    """Create/delete events for the entries of one directory."""

    MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        libc = _libc()
        fd = int(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise PlatformError(f"inotify_init1 failed: {os.strerror(err)}")
        self._fd = fd
        wd = int(libc.inotify_add_watch(fd, os.fsencode(directory), self.MASK))
        if wd < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise PlatformError(f"cannot watch {directory}: {os.strerror(err)}")
        # wake() ends a read() that waits with no timeout (the owner is stopping).
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closing = threading.Lock()  # wake() from another thread never writes a closed fd

    def fileno(self) -> int:
        return self._fd

    def read(self, timeout_s: float | None) -> list[InotifyEvent]:
        """Events that arrive within ``timeout_s`` (None: until one does, or :meth:`wake`);
        ``[]`` on timeout or a wake-up."""
        if self._fd < 0:
            raise PlatformError("the inotify watch is closed")
        records = _read_records(self._fd, timeout_s, f"for {self.directory} ", self._wake_read)
        return [InotifyEvent(mask, name) for _wd, mask, name in records]

    def wake(self) -> None:
        """End the current (or the next) read at once; from any thread."""
        with self._closing:
            if self._fd >= 0:
                with contextlib.suppress(BlockingIOError):  # a byte is there already: it wakes anyway
                    os.write(self._wake_write, b"\0")

    def close(self) -> None:
        with self._closing:
            if self._fd >= 0:
                os.close(self._fd)
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._fd = -1

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TreeEvent:
    """An entry created in (or the loss of) one of a ``TreeWatch``'s directories."""

    directory: Path
    event: InotifyEvent


class TreeWatch:
    """Create events for the entries of several directories on one inotify descriptor
    (the device gate's view of kubepods: new pod and container cgroups)."""

    MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF

    def __init__(self) -> None:
        self._libc = _libc()
        fd = int(self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            raise PlatformError(f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        self._dirs: dict[int, Path] = {}  # watch descriptor → directory
        self._paths: set[Path] = set()

    def add(self, directory: Path) -> bool:
        """Watch ``directory``; False when it does not exist (any more)."""
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(directory), self.MASK))
        if wd < 0:
            err = ctypes.get_errno()
            if err in (2, 20):  # ENOENT, ENOTDIR: gone before we looked
                return False
            raise PlatformError(f"cannot watch {directory}: {os.strerror(err)}")
        self._dirs[wd] = directory
        self._paths.add(directory)
        return True

    def watching(self, directory: Path) -> bool:
        return directory in self._paths

    def fileno(self) -> int:
        return self._fd

    def read(self, timeout_s: float) -> list[TreeEvent]:
        """Events that arrive within ``timeout_s``; ``[]`` on timeout. A lost directory's
        watch is dropped (its event still says so: ``watch_gone``)."""
        events: list[TreeEvent] = []
        for wd, mask, name in _read_records(self._fd, timeout_s, ""):
            directory = self._dirs.get(wd) if mask & IN_IGNORED == 0 else self._forget(wd)
            if directory is not None or mask & IN_Q_OVERFLOW:
                events.append(TreeEvent(directory or Path(), InotifyEvent(mask, name)))
        return events

    def _forget(self, wd: int) -> Path | None:
        directory = self._dirs.pop(wd, None)
        if directory is not None and directory not in self._dirs.values():
            self._paths.discard(directory)
        return directory

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._dirs.clear()
            self._paths.clear()


def _read_records(
    fd: int, timeout_s: float | None, what: str, wake_fd: int | None = None
) -> list[tuple[int, int, str]]:
    """(watch descriptor, mask, name) of the events that arrive within ``timeout_s`` (None:
    no timeout); a byte on ``wake_fd`` ends the wait too."""
    fds = [fd] if wake_fd is None else [fd, wake_fd]
    ready, _, _ = select.select(fds, [], [], None if timeout_s is None else max(0.0, timeout_s))
    if wake_fd is not None and wake_fd in ready:
        with contextlib.suppress(BlockingIOError):
            os.read(wake_fd, 64)
    if fd not in ready:
        return []
    try:
        data = os.read(fd, 64 * 1024)
    except BlockingIOError:
        return []
    except OSError as err:
        raise PlatformError(f"reading inotify events {what}failed: {err}") from err
    records = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
        raw = data[offset + _HEADER.size : offset + _HEADER.size + length]
        records.append((wd, mask, os.fsdecode(raw.rstrip(b"\0"))))
        offset += _HEADER.size + length
    return records
