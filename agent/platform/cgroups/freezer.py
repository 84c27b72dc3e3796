"""The cgroup freezer: pause and resume every process of a cgroup at once.

v2: ``cgroup.freeze`` ("1"/"0") and ``frozen`` in ``cgroup.events``; v1: ``freezer.state``
(FROZEN/THAWED, FREEZING while in progress). The duty-cycle controller writes these up
to 8 times a second per throttled container, so writes are plain os.open/os.write/
os.close with no directory listing or stat beforehand: the v2 file is tried first, then
the v1 file, and only when both are missing is the directory itself looked at (to tell a
removed cgroup from one that has no freezer).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from agent.errors import PlatformError

V2_FILE = "cgroup.freeze"
V2_EVENTS = "cgroup.events"
V1_FILE = "freezer.state"

# A cgroup directory that vanished (the container is gone): ENOENT when opening its
# files, ENODEV when writing through a file opened before the rmdir.
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV})


class FreezerError(PlatformError):
    """A cgroup's freezer could not be read or written."""


class CgroupGoneError(FreezerError):
    """The cgroup directory no longer exists (its container has exited)."""


def freezer_file(cgroup_dir: Path) -> Path | None:
    """The freezer file of ``cgroup_dir``: v2 ``cgroup.freeze``, else v1 ``freezer.state``, else None."""
    for name in (V2_FILE, V1_FILE):
        candidate = cgroup_dir / name
        if candidate.exists():
            return candidate
    return None


def freezer_access(cgroup_dir: Path) -> tuple[Path, bool] | None:
    """The freezer file of ``cgroup_dir`` and whether this process may write it; None when
    the directory has neither file; CgroupGoneError when the directory does not exist
    (not created yet, or removed)."""
    path = freezer_file(cgroup_dir)
    if path is None:
        if not cgroup_dir.is_dir():
            raise CgroupGoneError(f"cgroup {cgroup_dir} does not exist")
        return None
    return path, os.access(path, os.W_OK)


def set_frozen(cgroup_dir: Path, frozen: bool) -> None:
    """Freeze or thaw ``cgroup_dir``; raises CgroupGoneError when it was removed.

    On v2 the kernel completes the freeze asynchronously (``frozen 1`` in cgroup.events
    follows); on v1 the state may read FREEZING for a moment. Either way no process of
    the cgroup runs user code once the write returns, except those still finishing a
    system call.
    """
    v2 = cgroup_dir / V2_FILE
    try:
        _write(v2, b"1" if frozen else b"0")
        return
    except FileNotFoundError:
        pass
    v1 = cgroup_dir / V1_FILE
    try:
        _write(v1, b"FROZEN" if frozen else b"THAWED")
    except FileNotFoundError as err:
        if not cgroup_dir.is_dir():
            raise CgroupGoneError(f"cgroup {cgroup_dir} is gone") from err
        raise FreezerError(f"cgroup {cgroup_dir} has neither {V2_FILE} nor {V1_FILE}") from err


class OpenFreezers:
    """Freezer files kept open, one per cgroup: a throttled container is frozen and thawed
    several times a second, and the path lookup of each open() was most of a write's cost
    (bench/controller_cost.py). A removed cgroup fails the next write with ENODEV, which
    becomes CgroupGoneError as with set_frozen. Not thread-safe: the owner serialises."""

    def __init__(self) -> None:
        self._open: dict[Path, tuple[int, Path, bytes, bytes]] = {}

    def set(self, cgroup_dir: Path, frozen: bool) -> None:
        fd, path, freeze, thaw = self._entry(cgroup_dir)
        data = freeze if frozen else thaw
        try:
            os.pwrite(fd, data, 0)
        except OSError as err:
            self.close(cgroup_dir)
            raise _translate(path, f"write {data.decode()!r} to", err) from err

    def requested(self, cgroup_dir: Path) -> bool:
        """Whether the cgroup's own freezer file asks for frozen now, whoever wrote it (v2
        ``cgroup.freeze`` 1, v1 FROZEN or FREEZING): read on the open file, no path lookup."""
        fd, path, freeze, _ = self._entry(cgroup_dir)
        try:
            state = os.pread(fd, 16, 0).strip()
        except OSError as err:
            self.close(cgroup_dir)
            raise _translate(path, "read", err) from err
        return state in (freeze, b"FREEZING")

    def _entry(self, cgroup_dir: Path) -> tuple[int, Path, bytes, bytes]:
        entry = self._open.get(cgroup_dir)
        if entry is None:
            entry = self._open[cgroup_dir] = _open_freezer(cgroup_dir)
        return entry

    def close(self, cgroup_dir: Path) -> None:
        entry = self._open.pop(cgroup_dir, None)
        if entry is not None:
            os.close(entry[0])

    def close_all(self) -> None:
        for cgroup_dir in list(self._open):
            self.close(cgroup_dir)


def _open_freezer(cgroup_dir: Path) -> tuple[int, Path, bytes, bytes]:
    for name, freeze, thaw in ((V2_FILE, b"1", b"0"), (V1_FILE, b"FROZEN", b"THAWED")):
        path = cgroup_dir / name
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC), path, freeze, thaw
        except FileNotFoundError:
            continue
        except OSError as err:
            raise _translate(path, "open", err) from err
    if not cgroup_dir.is_dir():
        raise CgroupGoneError(f"cgroup {cgroup_dir} is gone")
    raise FreezerError(f"cgroup {cgroup_dir} has neither {V2_FILE} nor {V1_FILE}")


def is_frozen(cgroup_dir: Path) -> bool:
    """Whether ``cgroup_dir`` is frozen or on its way to frozen, by its own request or an ancestor's.

    v2: True when ``cgroup.freeze`` is 1 (freezing was requested here, even if the
    kernel has not finished) OR ``frozen`` in cgroup.events is 1 (effectively frozen,
    also when only an ancestor asked). v1: ``freezer.state`` is FROZEN or FREEZING,
    which the kernel already reports for ancestors' requests too. So False means no
    process of the cgroup is held by any freezer: the safe reading for "is it thawed?".
    """
    v2 = cgroup_dir / V2_FILE
    try:
        requested = _read(v2).strip() == "1"
    except FileNotFoundError:
        pass
    else:
        return requested or _events_frozen(cgroup_dir / V2_EVENTS)
    v1 = cgroup_dir / V1_FILE
    try:
        state = _read(v1).strip()
    except FileNotFoundError as err:
        if not cgroup_dir.is_dir():
            raise CgroupGoneError(f"cgroup {cgroup_dir} is gone") from err
        raise FreezerError(f"cgroup {cgroup_dir} has neither {V2_FILE} nor {V1_FILE}") from err
    return state in ("FROZEN", "FREEZING")


def _events_frozen(events: Path) -> bool:
    try:
        text = _read(events)
    except FileNotFoundError as err:
        raise CgroupGoneError(f"cgroup {events.parent} is gone") from err
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "frozen":
            return value.strip() == "1"
    return False


def _write(path: Path, data: bytes) -> None:
    """One write of ``data``; FileNotFoundError passes through (the caller tries the other file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise _translate(path, "open", err) from err
    try:
        os.write(fd, data)
    except OSError as err:
        raise _translate(path, f"write {data.decode()!r} to", err) from err
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise _translate(path, "read", err) from err


def _translate(path: Path, action: str, err: OSError) -> FreezerError:
    if err.errno in _GONE_ERRNOS:
        return CgroupGoneError(f"cgroup {path.parent} is gone ({action} {path}: {err.strerror})")
    return FreezerError(f"cannot {action} {path}: {err.strerror or err}")
