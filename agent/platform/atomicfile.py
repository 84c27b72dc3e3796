"""Whole-file writes that readers never see half done: a temp file in the same directory,
then a rename over the target.

The temp file starts with "." and ends in ".tmp" so that directory watchers which load
every ``*.json`` (CDI caches in containerd and CRI-O) never parse a partial spec.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.errors import PlatformError


def write_atomic(path: Path, data: bytes, mode: int = 0o644, durable: bool = False) -> None:
    """Replace ``path`` with ``data``; PlatformError (naming the path) if it cannot.

    The rename alone makes the replacement atomic for readers and for a process that dies.
    ``durable`` also fsyncs, for files that must survive a power loss; the agent's state and
    CDI directories are tmpfs (/run) on most nodes, where it costs time for nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # O_CREAT's mode is cut by the umask
            if durable:
                os.fsync(fd)  # the rename must not publish a file whose data is still only in cache
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise PlatformError(f"cannot write {path}: {err}") from err


def remove(path: Path) -> bool:
    """Delete ``path``; False if it was not there; PlatformError if it cannot be deleted."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as err:
        raise PlatformError(f"cannot remove {path}: {err}") from err
    return True
