"""The processes of a cgroup, from its ``cgroup.procs`` (any hierarchy)."""

from __future__ import annotations

from pathlib import Path

from agent.platform.cgroups.freezer import CgroupGoneError, FreezerError


def read_pids(procs_file: Path) -> list[int]:
    """The pids listed in ``procs_file``; CgroupGoneError when it is gone (the container
    exited), FreezerError when it cannot be read or holds something else than pids."""
    try:
        text = procs_file.read_text(encoding="ascii")
    except FileNotFoundError as err:
        raise CgroupGoneError(f"{procs_file} is gone") from err
    except (OSError, UnicodeDecodeError) as err:
        raise FreezerError(f"cannot read {procs_file}: {getattr(err, 'strerror', None) or err}") from err
    pids = []
    for line in text.split():
        try:
            pids.append(int(line))
        except ValueError as err:
            raise FreezerError(f"{procs_file} holds a non-numeric pid {line!r}") from err
    return pids
