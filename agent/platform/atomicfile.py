"""The agent's own files: whole-file writes that readers never see half done, reads that
tell a missing file from an unreadable one, and the directories they live in. Every
OSError becomes a PlatformError naming the path (``raise ... from err``), so the layers
above handle one family of errors and do no file I/O of their own.

A write goes to a temp file created exclusively in the target's directory (a rename
within one file system is atomic), is fsynced, renamed over the target, and the
directory is fsynced: after a crash the path holds the old content or the new one, never
a mix nor nothing. The temp file starts with "." and ends in ".tmp" so that directory
watchers which load every ``*.json`` (CDI caches in containerd and CRI-O) never parse a
partial spec. ``durable=False`` leaves out the two fsyncs and nothing else: for the
freeze journal, which the control loop writes before a first freeze (an fsync there
would stall every thaw on a slow disk) and which means nothing after a reboot.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from agent.errors import PlatformError


def write_atomic(
    path: Path, data: bytes, mode: int = 0o644, *, durable: bool = True, make_parents: bool = False
) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``, whatever the umask);
    ``make_parents``: create its missing parent directories first. PlatformError if it
    cannot; then ``path`` is as it was and no temp file is left."""
    if make_parents:
        ensure_dir(path.parent)
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise PlatformError(f"cannot write {path}: {err.strerror or err}") from err
    tmp = Path(name)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # mkstemp creates it 0600
            if durable:
                os.fsync(fd)  # the rename must not publish a file whose data is still only in cache
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise PlatformError(f"cannot write {path}: {err.strerror or err}") from err
    if durable:
        sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """fsync ``directory``, so that a rename or a new entry in it survives a crash."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise PlatformError(f"cannot sync the directory {directory}: {err.strerror or err}") from err


def read_text(path: Path) -> str | None:
    """The text of ``path``; None when there is no such file; PlatformError when it cannot
    be read (or is not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise PlatformError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from err


def ensure_dir(path: Path, mode: int | None = None) -> None:
    """Create ``path`` and its missing parents (a directory already there is fine);
    ``mode``: set on ``path`` itself whatever the umask. PlatformError if it cannot."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if mode is not None:
            os.chmod(path, mode)
    except OSError as err:
        raise PlatformError(f"cannot create the directory {path}: {err.strerror or err}") from err


def remove(path: Path) -> bool:
    """Delete ``path``; False if it was not there; PlatformError if it cannot be deleted."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as err:
        raise PlatformError(f"cannot remove {path}: {err.strerror or err}") from err
    return True
