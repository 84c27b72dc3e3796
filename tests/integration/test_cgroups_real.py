"""Detection and pid → container on this machine's real cgroups (hybrid: v1 + v2 at .../unified).

Kubepods-like trees are created under a unique test directory in the real hierarchies,
real processes are moved in through cgroup.procs, and the kernel's own /proc/<pid>/cgroup
is what the resolver reads back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from agent.platform.cgroups.detect import CgroupDriver, detect_runtime_facts
from agent.platform.cgroups.layout import UNIFIED, CgroupMode, detect_layout
from agent.platform.cgroups.paths import CgroupResolver, ContainerDirs, ContainerRef, QosClass
from tests.integration.cgroup_trees import CgroupTree, cgroup_tree, real_layout

pytestmark = pytest.mark.privileged

UID = "6b1e0a4c-97d2-4f0e-9a55-3c2b1d0e9f87"
UID_ = UID.replace("-", "_")
CID = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90"
CID2 = "0" * 63 + "1"


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with cgroup_tree() as made:
        yield made


def test_detects_this_machine() -> None:
    real = real_layout()
    layout = detect_layout()
    assert layout == real
    # docs/reference.md, "The development machine": hybrid, v2 at /sys/fs/cgroup/unified,
    # devices and freezer on v1.
    assert layout.mode == CgroupMode.HYBRID
    assert layout.v2_root == Path("/sys/fs/cgroup/unified")
    assert layout.root_for("devices") == Path("/sys/fs/cgroup/devices")
    assert (layout.root_for("freezer") / "freezer.state").exists() or (
        layout.root_for("freezer") / "tasks"
    ).exists()
    facts = detect_runtime_facts()
    assert facts.layout == layout
    assert facts.describe()[0] == "cgroup layout: hybrid (from /proc/self/mountinfo)"
    assert facts.driver in CgroupDriver


SYSTEMD_SCOPE = (
    f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
)
CGROUPFS_SCOPE = f"kubepods/besteffort/pod{UID}/crio-{CID}"


class PathCase(NamedTuple):
    driver: CgroupDriver
    controller: str
    relpath: str
    qos: QosClass
    leaf: str | None  # crun's subgroup, where the processes then live


PATH_CASES = {
    "v2-systemd-crun-leaf": PathCase(
        CgroupDriver.SYSTEMD, UNIFIED, SYSTEMD_SCOPE, QosClass.BURSTABLE, "container"
    ),
    "v2-systemd": PathCase(CgroupDriver.SYSTEMD, UNIFIED, SYSTEMD_SCOPE, QosClass.BURSTABLE, None),
    "v2-cgroupfs-crio": PathCase(CgroupDriver.CGROUPFS, UNIFIED, CGROUPFS_SCOPE, QosClass.BEST_EFFORT, None),
    "v1-devices-systemd": PathCase(CgroupDriver.SYSTEMD, "devices", SYSTEMD_SCOPE, QosClass.BURSTABLE, None),
    "v1-freezer-cgroupfs": PathCase(
        CgroupDriver.CGROUPFS, "freezer", CGROUPFS_SCOPE, QosClass.BEST_EFFORT, None
    ),
}


@pytest.mark.parametrize("case", PATH_CASES.values(), ids=PATH_CASES.keys())
def test_pid_to_container_on_real_cgroups(tree: CgroupTree, case: PathCase) -> None:
    controller, relpath = case.controller, case.relpath
    scope = tree.mkdir(controller, relpath)
    where = tree.mkdir(controller, Path(relpath) / case.leaf) if case.leaf else scope
    tree.mkdir(controller, Path(relpath).parent / Path(relpath).name.replace(CID, CID2))  # a neighbour
    resolver = CgroupResolver(tree.layout, case.driver)
    child = tree.sleeper()
    outsider = tree.sleeper()
    (where / "cgroup.procs").write_text(str(child.pid))

    dirs = ContainerDirs(scope, where)
    assert resolver.container_dirs(UID, case.qos, f"containerd://{CID}", controller) == dirs
    assert resolver.container_dirs(UID, None, CID, controller) == dirs
    assert resolver.pod_dir(UID, case.qos, controller) == scope.parent

    assert resolver.container_of_pid(child.pid) == ContainerRef(UID, CID)
    assert resolver.container_of_pid(outsider.pid) is None
    assert resolver.container_of_pid(os.getpid()) is None
    child.kill()
    child.wait()
    assert resolver.container_of_pid(child.pid) is None  # reaped: gone


def test_cgroup_id_index_on_the_real_v2_hierarchy(tree: CgroupTree) -> None:
    scope = tree.mkdir(UNIFIED, SYSTEMD_SCOPE)
    leaf = tree.mkdir(UNIFIED, Path(SYSTEMD_SCOPE) / "container")
    other = tree.mkdir(UNIFIED, SYSTEMD_SCOPE.replace(CID, CID2))
    tree.mkdir(UNIFIED, "kubepods.slice/kubepods-burstable.slice")  # exists: QoS level, not a container
    child = tree.sleeper()
    (leaf / "cgroup.procs").write_text(str(child.pid))

    index = CgroupResolver(tree.layout, CgroupDriver.SYSTEMD).index_cgroup_ids()
    assert index == {
        os.stat(scope).st_ino: ContainerRef(UID, CID),
        os.stat(leaf).st_ino: ContainerRef(UID, CID),
        os.stat(other).st_ino: ContainerRef(UID, CID2),
    }
    # The process's own cgroup, as the kernel names it in /proc/<pid>/cgroup, is in the index.
    v2_line = next(
        line for line in Path(f"/proc/{child.pid}/cgroup").read_text().splitlines() if line[:3] == "0::"
    )
    own = Path("/sys/fs/cgroup/unified") / v2_line[3:].lstrip("/")
    assert own == leaf
    assert index[os.stat(own).st_ino] == ContainerRef(UID, CID)


def test_index_of_200_containers_is_cheap(tree: CgroupTree) -> None:
    for n in range(100):
        uid = f"{n:08x}-0000-0000-0000-000000000000"
        for c in range(2):
            cid = f"{n:062x}{c:02x}"
            tree.mkdir(UNIFIED, f"kubepods/burstable/pod{uid}/{cid}")
    resolver = CgroupResolver(tree.layout, CgroupDriver.CGROUPFS)
    index = resolver.index_cgroup_ids()
    assert len(index) == 200
    started = time.perf_counter()
    for _ in range(5):
        resolver.index_cgroup_ids()
    per_call = (time.perf_counter() - started) / 5
    assert per_call < 0.25, f"index_cgroup_ids took {per_call * 1000:.1f} ms for 200 containers"
