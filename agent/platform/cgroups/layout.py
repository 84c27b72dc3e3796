"""Where the cgroup hierarchies are mounted: v1, v2 or hybrid, and each v1 controller's root.

Read from mountinfo (the mounts under the cgroup root); when mountinfo lists none there
(a fake tree in tests, a root bind-mounted from the host) the directory itself is
inspected: ``cgroup.controllers`` marks a v2 hierarchy, a controller's own files a v1 one.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import PlatformError

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_MOUNTINFO = Path("/proc/self/mountinfo")
_OCTAL = re.compile(r"\\([0-7]{3})")
UNIFIED = "unified"  # the controller name that means "the v2 hierarchy" to the resolver

# A file only a v1 hierarchy of that controller has; used when mountinfo says nothing.
_V1_MARKERS = {
    "devices": "devices.list",
    "freezer": "freezer.state",
    "cpu": "cpu.shares",
    "cpuacct": "cpuacct.usage",
    "cpuset": "cpuset.cpus",
    "memory": "memory.limit_in_bytes",
    "blkio": "blkio.weight",
    "pids": "pids.max",
    "hugetlb": "hugetlb.2MB.limit_in_bytes",
    "net_cls": "net_cls.classid",
    "net_prio": "net_prio.prioidx",
    "perf_event": "cgroup.procs",
    "rdma": "rdma.max",
    "misc": "misc.max",
    "systemd": "cgroup.procs",  # the named hierarchy systemd keeps on v1 ("name=systemd")
}


class CgroupMode(enum.StrEnum):
    V1 = "v1"  # only v1 hierarchies
    V2 = "v2"  # the unified hierarchy only, at the cgroup root
    HYBRID = "hybrid"  # v1 controllers plus an (often controller-less) v2 at <root>/unified


@dataclass(frozen=True)
class CgroupLayout:
    """The mounted hierarchies; tests build one rooted at a test tree."""

    mode: CgroupMode
    v2_root: Path | None = None  # the unified hierarchy, None when there is none
    v1_roots: dict[str, Path] = field(default_factory=dict)  # controller → mount point
    source: str = "mountinfo"  # where the facts came from, for logs

    def root_for(self, controller: str) -> Path:
        """The hierarchy that holds ``controller`` ("devices", "freezer", or UNIFIED for v2)."""
        if controller == UNIFIED:
            if self.v2_root is None:
                raise PlatformError(f"no cgroup v2 hierarchy is mounted ({self.mode} layout)")
            return self.v2_root
        if controller in self.v1_roots:
            return self.v1_roots[controller]
        if self.mode == CgroupMode.V2 and self.v2_root is not None:
            return self.v2_root  # on pure v2 every controller lives in the one hierarchy
        raise PlatformError(
            f"no cgroup v1 hierarchy for controller {controller!r} "
            f"(mounted: {', '.join(sorted(self.v1_roots)) or 'none'}); mount it or use cgroup v2"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": str(self.mode),
            "v2_root": str(self.v2_root) if self.v2_root else None,
            "v1_roots": {name: str(path) for name, path in sorted(self.v1_roots.items())},
            "source": self.source,
        }


@dataclass(frozen=True)
class CgroupMount:
    """One cgroup line of mountinfo."""

    mount_point: Path
    fs_type: str  # "cgroup" or "cgroup2"
    root: str  # the hierarchy path mounted here ("/" unless inside a cgroup namespace)
    controllers: tuple[str, ...]  # v1 only: "cpu", "cpuacct", "name=systemd", ...


def _unescape(field_text: str) -> str:
    # mountinfo octal-escapes space, tab, newline and backslash ("\\040").
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field_text)


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The visible cgroup and cgroup2 mounts of a mountinfo text (proc(5)); other lines are
    skipped, and so are mounts hidden under a later one at or above their mount point (a
    container runtime's own /sys/fs/cgroup under the host's bind-mounted over it)."""
    lines: list[tuple[Path, CgroupMount | None]] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        mount_point, fs_type, super_options = Path(_unescape(fields[4])), fields[sep + 1], fields[sep + 3]
        if fs_type not in ("cgroup", "cgroup2"):
            lines.append((mount_point, None))
            continue
        controllers: tuple[str, ...] = ()
        if fs_type == "cgroup":
            controllers = tuple(
                opt for opt in super_options.split(",") if opt in _V1_MARKERS or opt.startswith("name=")
            )
        lines.append((mount_point, CgroupMount(mount_point, fs_type, _unescape(fields[3]), controllers)))
    # mountinfo lists mounts in the order they were made: a later mount hides earlier ones.
    return [
        mount
        for index, (_, mount) in enumerate(lines)
        if mount is not None and not any(_is_under(mount.mount_point, over) for over, _ in lines[index + 1 :])
    ]


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _layout_from_mounts(mounts: list[CgroupMount], source: str) -> CgroupLayout | None:
    v2_root: Path | None = None
    v1_roots: dict[str, Path] = {}
    for mount in mounts:
        if mount.fs_type == "cgroup2":
            v2_root = v2_root or mount.mount_point
            continue
        for controller in mount.controllers:
            # "name=systemd" is the named hierarchy systemd keeps on v1; keep it as "systemd".
            v1_roots.setdefault(controller.removeprefix("name="), mount.mount_point)
    return _make_layout(v2_root, v1_roots, source)


def _make_layout(v2_root: Path | None, v1_roots: dict[str, Path], source: str) -> CgroupLayout | None:
    if v2_root is None and not v1_roots:
        return None
    if not v1_roots:
        mode = CgroupMode.V2
    elif v2_root is None:
        mode = CgroupMode.V1
    else:
        mode = CgroupMode.HYBRID
    return CgroupLayout(mode, v2_root, v1_roots, source)


def _layout_from_directory(root: Path) -> CgroupLayout | None:
    if (root / "cgroup.controllers").is_file():
        return _make_layout(root, {}, f"files under {root}")
    v2_root = root / "unified" if (root / "unified" / "cgroup.controllers").is_file() else None
    v1_roots: dict[str, Path] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as err:
        raise PlatformError(f"cannot list the cgroup root {root}: {err}") from err
    for entry in entries:
        if not entry.is_dir() or entry.is_symlink() or entry.name == "unified":
            continue
        names = entry.name.split(",")  # co-mounted controllers: "cpu,cpuacct"
        path = Path(entry.path)
        for name in names:
            marker = _V1_MARKERS.get(name)
            if marker and (path / marker).exists():
                v1_roots.setdefault(name, path)
    return _make_layout(v2_root, v1_roots, f"files under {root}")


def detect_layout(
    cgroup_root: Path = DEFAULT_CGROUP_ROOT, mountinfo: Path = DEFAULT_MOUNTINFO
) -> CgroupLayout:
    """The hierarchies mounted at or under ``cgroup_root``; PlatformError when there are none."""
    try:
        text = mountinfo.read_text()
    except OSError:
        text = ""  # no mountinfo to go by: the directory tells
    mounts = [m for m in parse_mountinfo(text) if _is_under(m.mount_point, cgroup_root)]
    layout = _layout_from_mounts(mounts, str(mountinfo)) or _layout_from_directory(cgroup_root)
    if layout is None:
        raise PlatformError(
            f"no cgroup hierarchy found at {cgroup_root} (mountinfo {mountinfo} lists none there "
            "and the directory has no cgroup files): mount the host's /sys/fs/cgroup into the agent"
        )
    return layout
