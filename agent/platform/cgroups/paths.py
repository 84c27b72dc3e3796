"""Pod and container cgroup paths (docs/reference.md, "Pod and container cgroup paths"),
forwards and backwards.

Forwards: pod UID + QoS class + container ID → the container's cgroup directory in a
given hierarchy. systemd driver::

    kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/<prefix><id>.scope
    kubepods.slice/kubepods-pod<uid_>.slice/...                       (Guaranteed)

with prefixes ``cri-containerd-``, ``crio-``, ``docker-``; cgroupfs driver::

    kubepods[/burstable|/besteffort]/pod<uid>/<id>      (CRI-O: crio-<id>)

crun on v2 may put the processes in a ``container`` subgroup of the scope, so a
container has two directories: the *scope* (the runtime's cgroup: device programs and
the freezer go there and cover the subgroup) and the *leaf* where its processes live
(the scope itself when there is no subgroup). A missing directory is ``None``: the
pod or container has not started yet, or has gone.

Backwards: a cgroup path (from /proc/<pid>/cgroup or a walk of the v2 hierarchy) →
(pod UID, container ID), for both drivers, every runtime and the crun subgroup.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import PlatformError
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.layout import UNIFIED, CgroupLayout

SYSTEMD_PREFIXES = ("cri-containerd-", "crio-", "docker-")
CGROUPFS_PREFIXES = ("", "crio-")
CRUN_LEAF = "container"
# kubepods/<qos>/<pod>/<container>/<leaf>: deeper dirs are a container's own nested cgroups.
_INDEX_DEPTH = 6

_SYSTEMD_POD = re.compile(r"^(?:.+-)?kubepods(?:-burstable|-besteffort)?-pod([0-9a-fA-F_]+)\.slice$")
_CGROUPFS_POD = re.compile(r"^pod([0-9a-fA-F-]+)$")
_SYSTEMD_CONTAINER = re.compile(r"^(?:cri-containerd|crio|docker)-([0-9a-f]{64})\.scope$")
_CGROUPFS_CONTAINER = re.compile(r"^(?:crio-)?([0-9a-f]{64})$")


class QosClass(enum.StrEnum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


@dataclass(frozen=True)
class ContainerRef:
    """A container as cgroups name it: its pod's UID and its bare runtime ID."""

    pod_uid: str
    container_id: str


@dataclass(frozen=True)
class ContainerDirs:
    scope: Path  # the runtime's cgroup for the container: rules and freezing go here
    leaf: Path  # where the processes are: ``scope/container`` under crun, else ``scope``


def bare_container_id(container_id: str) -> str:
    """``containerd://abc`` (as in a pod's status) → ``abc``."""
    return container_id.split("://", 1)[-1]


def _qos_list(qos: QosClass | str | None) -> list[QosClass]:
    if qos is None:
        return list(QosClass)
    try:
        return [QosClass(qos)]
    except ValueError:
        return list(QosClass)  # unknown class: try every one


def pod_relpath(driver: CgroupDriver, pod_uid: str, qos: QosClass) -> Path:
    """The pod's directory relative to a hierarchy root."""
    if driver == CgroupDriver.SYSTEMD:
        uid = pod_uid.replace("-", "_")
        if qos == QosClass.GUARANTEED:
            return Path("kubepods.slice", f"kubepods-pod{uid}.slice")
        tier = "burstable" if qos == QosClass.BURSTABLE else "besteffort"
        return Path("kubepods.slice", f"kubepods-{tier}.slice", f"kubepods-{tier}-pod{uid}.slice")
    if qos == QosClass.GUARANTEED:
        return Path("kubepods", f"pod{pod_uid}")
    tier = "burstable" if qos == QosClass.BURSTABLE else "besteffort"
    return Path("kubepods", tier, f"pod{pod_uid}")


def pod_uid_of(name: str) -> str | None:
    """The pod UID a pod directory's name carries (either driver); None for other names."""
    systemd = _SYSTEMD_POD.match(name)
    if systemd:
        return systemd.group(1).replace("_", "-")
    cgroupfs = _CGROUPFS_POD.match(name)
    return cgroupfs.group(1) if cgroupfs else None


def qos_dir_names(driver: CgroupDriver) -> tuple[str, ...]:
    """The Burstable and BestEffort parents inside kubepods (Guaranteed pods sit in kubepods)."""
    if driver == CgroupDriver.SYSTEMD:
        return ("kubepods-burstable.slice", "kubepods-besteffort.slice")
    return ("burstable", "besteffort")


def container_names(driver: CgroupDriver, container_id: str) -> list[str]:
    """The names a container's directory may have inside its pod's directory."""
    cid = bare_container_id(container_id)
    if driver == CgroupDriver.SYSTEMD:
        return [f"{prefix}{cid}.scope" for prefix in SYSTEMD_PREFIXES]
    return [f"{prefix}{cid}" for prefix in CGROUPFS_PREFIXES]


def parse_cgroup_path(path: str) -> ContainerRef | None:
    """(pod UID, container ID) of a cgroup path; None when it is not inside a pod's container."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts[:-1]):
        systemd = _SYSTEMD_POD.match(part)
        if systemd:
            uid = systemd.group(1).replace("_", "-")
        else:
            cgroupfs = _CGROUPFS_POD.match(part)
            if cgroupfs is None or not any("kubepods" in p for p in parts[:i]):
                continue
            uid = cgroupfs.group(1)
        container = _SYSTEMD_CONTAINER.match(parts[i + 1]) or _CGROUPFS_CONTAINER.match(parts[i + 1])
        if container is None:
            return None  # a pod's own cgroup, or something a runtime keeps beside containers
        return ContainerRef(uid, container.group(1))
    return None


def parse_proc_cgroup(text: str) -> ContainerRef | None:
    """The container of a /proc/<pid>/cgroup text (v2 ``0::/...`` and v1 lines alike)."""
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    # The v2 line first: on hybrid nodes it is the one eBPF's cgroup ids refer to.
    lines.sort(key=lambda fields: fields[0] != "0")
    for fields in lines:
        ref = parse_cgroup_path(fields[2])
        if ref is not None:
            return ref
    return None


class CgroupResolver:
    """Resolves pods and containers to directories in one layout, for one cgroup driver.

    Only directories under the layout's ``kubepods`` roots are ever returned, so the
    callers that write to them cannot stray outside Kubernetes' part of the tree.
    """

    def __init__(self, layout: CgroupLayout, driver: CgroupDriver, proc_root: Path = Path("/proc")) -> None:
        self.layout = layout
        self.driver = driver
        self.proc_root = proc_root

    def kubepods_root(self, controller: str = UNIFIED) -> Path:
        name = "kubepods.slice" if self.driver == CgroupDriver.SYSTEMD else "kubepods"
        return self.layout.root_for(controller) / name

    def pod_dir(self, pod_uid: str, qos: QosClass | str | None, controller: str = UNIFIED) -> Path | None:
        """The pod's directory; None when it does not exist (yet)."""
        root = self.layout.root_for(controller)
        for qos_class in _qos_list(qos):
            path = root / pod_relpath(self.driver, pod_uid, qos_class)
            if path.is_dir():
                return path
        return None

    def container_dirs(
        self, pod_uid: str, qos: QosClass | str | None, container_id: str, controller: str = UNIFIED
    ) -> ContainerDirs | None:
        """The container's scope and leaf directories; None when it does not exist (yet)."""
        pod = self.pod_dir(pod_uid, qos, controller)
        if pod is None:
            return None
        for name in container_names(self.driver, container_id):
            scope = pod / name
            if scope.is_dir():
                leaf = scope / CRUN_LEAF
                return ContainerDirs(scope, leaf if leaf.is_dir() else scope)
        return None

    def container_dir(
        self, pod_uid: str, qos: QosClass | str | None, container_id: str, controller: str = UNIFIED
    ) -> Path | None:
        """The container's scope directory (see ``ContainerDirs``)."""
        dirs = self.container_dirs(pod_uid, qos, container_id, controller)
        return dirs.scope if dirs else None

    def container_of_pid(self, pid: int) -> ContainerRef | None:
        """The pod container a process runs in; None for other processes and exited ones."""
        path = self.proc_root / str(pid) / "cgroup"
        try:
            text = path.read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError as err:
            raise PlatformError(f"cannot read {path}: {err}") from err
        return parse_proc_cgroup(text)

    def index_cgroup_ids(self) -> dict[int, ContainerRef]:
        """{v2 cgroup id: container} for every container dir (and its subgroups) in the v2 tree.

        A v2 cgroup's id (what ``bpf_get_current_cgroup_id()`` returns) is its directory's
        inode number, which directory listing returns without a stat per entry.
        Empty when there is no v2 hierarchy or no pod in it.
        """
        if self.layout.v2_root is None:
            return {}
        root = self.kubepods_root(UNIFIED)
        index: dict[int, ContainerRef] = {}
        for inode, relpath in _walk_dirs(root, _INDEX_DEPTH):
            ref = parse_cgroup_path(f"{root.name}/{relpath}")
            if ref is not None:
                index[inode] = ref
        return index


def _walk_dirs(root: Path, depth: int) -> Iterable[tuple[int, str]]:
    """(inode, path relative to root) of the directories below root, ``depth`` levels at most."""
    stack: list[tuple[str, str, int]] = [(str(root), "", 0)]
    while stack:
        path, rel, level = stack.pop()
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    child_rel = f"{rel}/{entry.name}" if rel else entry.name
                    yield entry.inode(), child_rel
                    if level + 1 < depth:
                        stack.append((entry.path, child_rel, level + 1))
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed while we walked: a pod going away
        except OSError as err:
            raise PlatformError(f"cannot list cgroup directory {path}: {err}") from err
