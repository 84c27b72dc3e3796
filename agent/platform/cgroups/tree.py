"""Walking and removing cgroup trees that change while they are walked.

A cgroup directory vanishes whenever its runtime removes it (a container stopping, a pod
going away), so a walk of ``kubepods`` may find a directory listed by its parent and gone
a moment later. ``Path.rglob`` raises ``FileNotFoundError`` then; these helpers treat a
vanished directory as what it is, one less to visit (or to remove).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from agent.errors import PlatformError

RMDIR_RETRY_S = 0.02


def dirs_deepest_first(top: Path) -> list[Path]:
    """Every directory below ``top`` (not ``top``), the deepest first; directories removed
    during the walk are skipped, never an error."""
    found: list[Path] = []
    # os.walk skips a directory it cannot list (onerror=None): one removed meanwhile.
    for parent, dirnames, _files in os.walk(top, topdown=False):
        found.extend(Path(parent) / name for name in dirnames)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def files_named(top: Path, name: str) -> list[Path]:
    """The files called ``name`` below ``top`` (``cgroup.freeze``, ``cgroup.procs``), as far as
    they still exist during the walk."""
    return [Path(parent) / name for parent, _dirs, files in os.walk(top) if name in files]


def remove_tree(top: Path, *, busy_wait_s: float = 10.0) -> None:
    """Remove the empty cgroup directories under ``top`` and ``top`` itself, deepest first.

    A cgroup stays busy while a killed container's last process exits, or its shim cleans
    up: each directory gets ``busy_wait_s`` to become removable. One already gone (its runtime
    removed it meanwhile) is fine; any other error is a :class:`PlatformError`."""
    for path in [*dirs_deepest_first(top), top]:
        remove_dir(path, busy_wait_s=busy_wait_s)


def remove_dir(path: Path, *, busy_wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + busy_wait_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise PlatformError(f"cannot remove cgroup {path}: {err}") from err
        time.sleep(RMDIR_RETRY_S)
