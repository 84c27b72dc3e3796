"""Pod/container cgroup paths over fake trees: every driver x version x runtime x QoS cell,
crun's leaf, and pid → container from real-looking /proc/<pid>/cgroup texts."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.layout import UNIFIED, CgroupLayout, CgroupMode
from agent.platform.cgroups.paths import (
    CgroupResolver,
    ContainerDirs,
    ContainerRef,
    QosClass,
    bare_container_id,
    parse_cgroup_path,
    parse_proc_cgroup,
)

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
UID_ = UID.replace("-", "_")
CID = "4c5ad2f2a2b2f7bbf0a3a1d9b8e7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9"
OTHER_CID = "9" * 64
RUNTIMES = ("containerd", "cri-o", "docker")
SYSTEMD_PREFIX = {"containerd": "cri-containerd-", "cri-o": "crio-", "docker": "docker-"}
CGROUPFS_PREFIX = {"containerd": "", "cri-o": "crio-", "docker": ""}


def expected_relpath(driver: CgroupDriver, runtime: str, qos: QosClass) -> str:
    """The paths as kubelet and the runtimes create them (docs/reference.md, "Pod and container
    cgroup paths"), written out by hand."""
    if driver == CgroupDriver.SYSTEMD:
        pod = {
            QosClass.GUARANTEED: f"kubepods.slice/kubepods-pod{UID_}.slice",
            QosClass.BURSTABLE: f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
            QosClass.BEST_EFFORT: (
                f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
            ),
        }[qos]
        return f"{pod}/{SYSTEMD_PREFIX[runtime]}{CID}.scope"
    pod = {
        QosClass.GUARANTEED: f"kubepods/pod{UID}",
        QosClass.BURSTABLE: f"kubepods/burstable/pod{UID}",
        QosClass.BEST_EFFORT: f"kubepods/besteffort/pod{UID}",
    }[qos]
    return f"{pod}/{CGROUPFS_PREFIX[runtime]}{CID}"


def fake_layout(root: Path, version: str) -> CgroupLayout:
    if version == "v2":
        return CgroupLayout(CgroupMode.V2, v2_root=root)
    return CgroupLayout(
        CgroupMode.HYBRID,
        v2_root=root / "unified",
        v1_roots={"devices": root / "devices", "freezer": root / "freezer"},
    )


CELLS = list(itertools.product(CgroupDriver, ("v1", "v2"), RUNTIMES, QosClass))


def test_the_table_has_every_cell() -> None:
    assert len(CELLS) == 2 * 2 * 3 * 3


@pytest.mark.parametrize(("driver", "version", "runtime", "qos"), CELLS, ids=str)
def test_container_dir_for_every_cell(
    tmp_path: Path, driver: CgroupDriver, version: str, runtime: str, qos: QosClass
) -> None:
    layout = fake_layout(tmp_path, version)
    controller = "devices" if version == "v1" else UNIFIED
    hierarchy = layout.root_for(controller)
    scope = hierarchy / expected_relpath(driver, runtime, qos)
    scope.mkdir(parents=True)
    # A neighbour container and a neighbour pod in the other QoS classes must not be picked up.
    (scope.parent / scope.name.replace(CID, OTHER_CID)).mkdir()
    resolver = CgroupResolver(layout, driver)

    dirs = resolver.container_dirs(UID, qos, f"{runtime}://{CID}", controller)
    assert dirs == ContainerDirs(scope=scope, leaf=scope)
    assert resolver.container_dir(UID, qos, CID, controller) == scope
    assert resolver.container_dir(UID, None, CID, controller) == scope  # QoS unknown: all tried
    assert resolver.container_dir(UID, "Weird", CID, controller) == scope
    assert resolver.pod_dir(UID, qos, controller) == scope.parent
    others = [q for q in QosClass if q != qos]
    assert all(resolver.container_dir(UID, q, CID, controller) is None for q in others)
    assert resolver.container_dir(UID, qos, "f" * 64, controller) is None
    assert resolver.container_dir(UID.replace("0f", "aa"), qos, CID, controller) is None

    # The same path read back, as /proc/<pid>/cgroup would show it.
    assert parse_cgroup_path("/" + expected_relpath(driver, runtime, qos)) == ContainerRef(UID, CID)


@pytest.mark.parametrize("driver", list(CgroupDriver))
def test_crun_leaf_is_reported_beside_the_scope(tmp_path: Path, driver: CgroupDriver) -> None:
    layout = fake_layout(tmp_path, "v2")
    scope = tmp_path / expected_relpath(driver, "cri-o", QosClass.BURSTABLE)
    (scope / "container").mkdir(parents=True)
    resolver = CgroupResolver(layout, driver)
    assert resolver.container_dirs(UID, QosClass.BURSTABLE, CID) == ContainerDirs(scope, scope / "container")
    assert parse_cgroup_path(f"/{expected_relpath(driver, 'cri-o', QosClass.BURSTABLE)}/container") == (
        ContainerRef(UID, CID)
    )


def test_missing_directories_are_none_not_errors(tmp_path: Path) -> None:
    resolver = CgroupResolver(fake_layout(tmp_path, "v2"), CgroupDriver.SYSTEMD)
    assert resolver.pod_dir(UID, QosClass.BURSTABLE) is None
    assert resolver.container_dirs(UID, None, CID) is None
    assert resolver.index_cgroup_ids() == {}


def test_v1_controller_without_a_hierarchy_is_an_error(tmp_path: Path) -> None:
    resolver = CgroupResolver(fake_layout(tmp_path, "v1"), CgroupDriver.SYSTEMD)
    with pytest.raises(Exception, match="no cgroup v1 hierarchy for controller 'cpu'"):
        resolver.container_dir(UID, None, CID, "cpu")


def test_bare_container_id() -> None:
    assert bare_container_id("containerd://abc") == "abc"
    assert bare_container_id("cri-o://abc") == "abc"
    assert bare_container_id("abc") == "abc"


# Real-looking /proc/<pid>/cgroup contents.
BESTEFFORT_POD = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
PROC_CGROUP_CASES = {
    "v2 systemd containerd": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
        f"cri-containerd-{CID}.scope\n"
    ),
    "v2 systemd crio crun leaf": (
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope/container\n"
    ),
    "v2 cgroupfs containerd": f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
    "v1 systemd docker": "\n".join(
        [
            f"12:devices:/{BESTEFFORT_POD}/docker-{CID}.scope",
            f"11:cpu,cpuacct:/{BESTEFFORT_POD}/docker-{CID}.scope",
            f"1:name=systemd:/{BESTEFFORT_POD}/docker-{CID}.scope",
            "0::/",
        ]
    ),
    "v1 cgroupfs crio": "\n".join(
        [f"{n}:{c}:/kubepods/burstable/pod{UID}/crio-{CID}" for n, c in ((9, "freezer"), (5, "devices"))]
        + ["0::/"]
    ),
    "hybrid v2 line names a system slice": "\n".join(
        [f"5:devices:/kubepods/pod{UID}/{CID}", "0::/system.slice/containerd.service"]
    ),
    "kind's nested kubelet slice": (
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
    ),
    "under a test prefix": f"0::/vcuda-test-ab12/kubepods/pod{UID}/{CID}\n",
}


@pytest.mark.parametrize("text", PROC_CGROUP_CASES.values(), ids=PROC_CGROUP_CASES.keys())
def test_proc_cgroup_of_pod_processes(text: str) -> None:
    assert parse_proc_cgroup(text) == ContainerRef(UID, CID)


NOT_A_CONTAINER = {
    "root": "0::/\n",
    "a system service": "0::/system.slice/containerd.service\n",
    "a user session": "0::/user.slice/user-0.slice/session-3.scope\n",
    "the pod cgroup itself": f"0::/kubepods.slice/kubepods-pod{UID_}.slice\n",
    "CRI-O's conmon": f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
    "pod dir outside kubepods": f"0::/somewhere/pod{UID}/{CID}\n",
    "short id": f"0::/kubepods/pod{UID}/abc123\n",
    "empty": "",
}


@pytest.mark.parametrize("text", NOT_A_CONTAINER.values(), ids=NOT_A_CONTAINER.keys())
def test_proc_cgroup_of_other_processes(text: str) -> None:
    assert parse_proc_cgroup(text) is None


def test_container_of_pid_reads_the_injected_proc(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(PROC_CGROUP_CASES["v2 cgroupfs containerd"])
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "cgroup").write_text("0::/system.slice/sshd.service\n")
    resolver = CgroupResolver(fake_layout(tmp_path / "cg", "v2"), CgroupDriver.CGROUPFS, proc_root=tmp_path)
    assert resolver.container_of_pid(42) == ContainerRef(UID, CID)
    assert resolver.container_of_pid(43) is None
    assert resolver.container_of_pid(44) is None  # exited


@pytest.mark.parametrize("driver", list(CgroupDriver))
def test_index_cgroup_ids_maps_inodes_of_scopes_and_leaves(tmp_path: Path, driver: CgroupDriver) -> None:
    layout = fake_layout(tmp_path, "v2")
    expected: dict[int, ContainerRef] = {}
    for n, qos in enumerate(QosClass):
        uid = UID[:-1] + str(n)
        for runtime in RUNTIMES:
            cid = f"{n}{RUNTIMES.index(runtime)}" + CID[2:]
            rel = expected_relpath(driver, runtime, qos).replace(UID_, uid.replace("-", "_"))
            scope = tmp_path / rel.replace(UID, uid).replace(CID, cid)
            (scope / "container").mkdir(parents=True)
            for path in (scope, scope / "container"):
                expected[os.stat(path).st_ino] = ContainerRef(uid, cid)
    # Things beside containers in a pod dir are not containers.
    pod_dir = (tmp_path / expected_relpath(driver, "containerd", QosClass.GUARANTEED)).parent
    (pod_dir / "junk").mkdir()
    index = CgroupResolver(layout, driver).index_cgroup_ids()
    assert index == expected
    assert len(index) == 3 * 3 * 2
