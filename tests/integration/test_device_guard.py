"""The device guard against the real kernel, on cgroup v2 (BPF program) and v1 (devices.deny).

Device nodes are made with mknod in a temp dir; there is no NVIDIA driver here, so an
open the cgroup lets through fails with ENXIO, one the cgroup refuses fails with EPERM.
A probe process is moved into the container's cgroup before it opens anything.
The dynamic NVIDIA majors come from a fake /proc/devices (majors unused on this machine).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.control.deviceguard import DeviceGuard, GuardTarget
from agent.platform.bpf import syscall
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devices_v1 import V1DeviceRules, parse_devices_list
from agent.platform.cgroups.devices_v2 import PROG_NAME, BpfDeviceRules
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import CgroupResolver
from agent.settings import GuardMode
from tests.integration.cgroup_trees import CgroupTree, Prober, cgroup_tree

pytestmark = pytest.mark.privileged

EPERM, ENXIO = errno.EPERM, errno.ENXIO
UVM_MAJOR, CAPS_MAJOR = 240, 241  # free on this machine (see /proc/devices)
UID = "0d6f5a2e-1c3b-4e8f-9a7d-6b5c4d3e2f10"
UID_ = UID.replace("-", "_")
CID = "c0ffee" + "0" * 58
CID_OTHER = "beef" + "1" * 60
POD = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
LABEL = "default/gpu-pod/main"
RUNC_WHITELIST = ["c *:* m", "b *:* m", "c 1:3 rwm", "c 1:5 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 136:* rwm"]


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with cgroup_tree() as made:
        yield made


@pytest.fixture(scope="module")
def bpf_rules() -> Iterator[BpfDeviceRules]:
    """One compiled program for the module's tests, as in the agent."""
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    rules = BpfDeviceRules()
    rules.load()
    yield rules
    rules.close()


@pytest.fixture
def nodes(tmp_path: Path) -> dict[str, Path]:
    """Device nodes and a fake /proc with the dynamic NVIDIA majors."""
    made = {
        "nvidia0": (195, 0),
        "nvidia1": (195, 1),
        "nvidiactl": (195, 255),
        "nvidia-modeset": (195, 254),
        "nvidia-uvm": (UVM_MAJOR, 0),
        "nvidia-cap1": (CAPS_MAJOR, 1),
    }
    paths = {}
    for name, (major, minor) in made.items():
        path = tmp_path / name
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        paths[name] = path
    paths["null"] = Path("/dev/null")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text(
        f"Character devices:\n  1 mem\n195 nvidia\n{UVM_MAJOR} nvidia-uvm\n{CAPS_MAJOR} nvidia-caps\n\n"
        "Block devices:\n  7 loop\n"
    )
    paths["proc"] = proc
    return paths


def errnos(prober: Prober, nodes: dict[str, Path], names: list[str]) -> dict[str, int]:
    """The errno of opening each named node from the prober's cgroup (0: opened)."""
    return {name: prober.open_errno(nodes[name]) for name in names}


ALL = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-cap1", "null"]
UNGUARDED = {"nvidia0": ENXIO, "nvidia1": ENXIO, "nvidiactl": ENXIO, "nvidia-modeset": ENXIO}
UNGUARDED |= {"nvidia-uvm": ENXIO, "nvidia-cap1": ENXIO, "null": 0}
GPU1 = {"nvidia0": EPERM, "nvidia1": ENXIO, "nvidiactl": ENXIO, "nvidia-modeset": EPERM}
GPU1 |= {"nvidia-uvm": ENXIO, "nvidia-cap1": EPERM, "null": 0}
NO_GPU = {"nvidia0": EPERM, "nvidia1": EPERM, "nvidiactl": EPERM, "nvidia-modeset": EPERM}
NO_GPU |= {"nvidia-uvm": EPERM, "nvidia-cap1": EPERM, "null": 0}


def guard_for(
    tree: CgroupTree,
    rules: BpfDeviceRules | V1DeviceRules,
    targets: list[GuardTarget],
    nodes: dict[str, Path],
    *,
    driver: CgroupDriver = CgroupDriver.SYSTEMD,
    mode: GuardMode = GuardMode.ENFORCE,
) -> DeviceGuard:
    resolver = CgroupResolver(tree.layout, driver)
    return DeviceGuard(lambda: list(targets), resolver, rules, mode=mode, proc_root=nodes["proc"])


def load_runtime_programs() -> tuple[Any, int, int]:
    """Two device programs that allow everything: a runtime's own, before and after an update."""
    import bcc  # noqa: PLC0415

    prog = bcc.BPF(
        text=b"int runc_old(struct bpf_cgroup_dev_ctx *ctx) { return 1; }\n"
        b"int runc_new(struct bpf_cgroup_dev_ctx *ctx) { return 1; }\n"
    )
    old, new = (prog.load_func(name, bcc.BPF.CGROUP_DEVICE).fd for name in (b"runc_old", b"runc_new"))
    return prog, old, new


# -- cgroup v2 ------------------------------------------------------------------------------------


def test_v2_gpu_container_survives_a_runtime_update_and_removal(
    tree: CgroupTree, bpf_rules: BpfDeviceRules, nodes: dict[str, Path]
) -> None:
    scope = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope")
    leaf = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope/container")  # crun's subgroup
    neighbour = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID_OTHER}.scope")
    runc_prog, runc_old, runc_new = load_runtime_programs()
    scope_fd = os.open(scope, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syscall.prog_attach(runc_old, scope_fd, syscall.BPF_CGROUP_DEVICE, syscall.BPF_F_ALLOW_MULTI)
        targets = [GuardTarget(UID, "Burstable", f"containerd://{CID}", frozenset({1}), LABEL)]
        guard = guard_for(tree, bpf_rules, targets, nodes)
        inside, outside = tree.prober(), tree.prober()
        inside.join(leaf)
        outside.join(neighbour)

        assert guard.reconcile_once().applied == [LABEL]
        assert len(syscall.prog_query(scope_fd, syscall.BPF_CGROUP_DEVICE)) == 2  # runc's and ours
        assert errnos(inside, nodes, ALL) == GPU1
        assert errnos(outside, nodes, ALL) == UNGUARDED
        assert guard.stats().denied == {LABEL: 3}

        # runc updating the container: attach its new program, detach every old one (ours too).
        old_ids = syscall.prog_query(scope_fd, syscall.BPF_CGROUP_DEVICE)
        syscall.prog_attach(runc_new, scope_fd, syscall.BPF_CGROUP_DEVICE, syscall.BPF_F_ALLOW_MULTI)
        for prog_id in old_ids:
            syscall.detach_by_id(scope_fd, syscall.BPF_CGROUP_DEVICE, prog_id)
        assert len(syscall.prog_query(scope_fd, syscall.BPF_CGROUP_DEVICE)) == 1
        assert inside.open_errno(nodes["nvidia0"]) == ENXIO  # the hole a reconcile must close

        report = guard.reconcile_once()
        assert report.reattached == [LABEL] and not report.errors
        assert bpf_rules.attached_to(scope)
        assert errnos(inside, nodes, ALL) == GPU1
        assert guard.stats().reattachments == 1

        assert guard.reconcile_once().unchanged == 1  # quiet when nothing changed

        targets.clear()  # the pod went
        assert guard.reconcile_once().removed == [LABEL]
        assert not bpf_rules.attached_to(scope)
        assert errnos(inside, nodes, ALL) == UNGUARDED
        assert len(syscall.prog_query(scope_fd, syscall.BPF_CGROUP_DEVICE)) == 1  # runc's stays
    finally:
        os.close(scope_fd)
        runc_prog.cleanup()


def test_v2_pod_without_gpu_gets_no_nvidia_device(
    tree: CgroupTree, bpf_rules: BpfDeviceRules, nodes: dict[str, Path]
) -> None:
    scope = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope")
    guard = guard_for(tree, bpf_rules, [GuardTarget(UID, None, CID, None, LABEL)], nodes)
    probe = tree.prober()
    probe.join(scope)
    assert guard.reconcile_once().applied == [LABEL]
    assert errnos(probe, nodes, ALL) == NO_GPU
    assert guard.stats().denied == {LABEL: 6}


def test_v2_audit_counts_and_denies_nothing(
    tree: CgroupTree, bpf_rules: BpfDeviceRules, nodes: dict[str, Path]
) -> None:
    scope = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope")
    targets = [GuardTarget(UID, None, CID, frozenset({1}), LABEL)]
    guard = guard_for(tree, bpf_rules, targets, nodes, mode=GuardMode.AUDIT)
    probe = tree.prober()
    probe.join(scope)
    assert guard.reconcile_once().applied == [LABEL]
    assert bpf_rules.attached_to(scope)
    assert errnos(probe, nodes, ALL) == UNGUARDED
    assert guard.stats().denied == {LABEL: 3}  # nvidia0, modeset, caps would have been denied
    targets.clear()
    assert guard.reconcile_once().removed == [LABEL]
    assert not bpf_rules.attached_to(scope)


def test_v2_program_of_an_earlier_agent_is_replaced(
    tree: CgroupTree, bpf_rules: BpfDeviceRules, nodes: dict[str, Path]
) -> None:
    scope = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope")
    target = GuardTarget(UID, None, CID, frozenset({1}), LABEL)
    earlier = BpfDeviceRules()  # the agent that ran before this one, its program left attached
    guard_for(tree, earlier, [target], nodes).reconcile_once()
    earlier_id = earlier.prog_id
    earlier.close()
    fd = os.open(scope, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert syscall.prog_query(fd, syscall.BPF_CGROUP_DEVICE) == [earlier_id]
        assert syscall.prog_info_by_id(earlier_id).name == PROG_NAME
        probe = tree.prober()
        probe.join(scope)
        assert probe.open_errno(nodes["nvidia0"]) == EPERM  # still enforcing with nobody home

        guard = guard_for(tree, bpf_rules, [target], nodes)
        assert guard.reconcile_once().applied == [LABEL]
        assert syscall.prog_query(fd, syscall.BPF_CGROUP_DEVICE) == [bpf_rules.prog_id]
        assert errnos(probe, nodes, ALL) == GPU1
    finally:
        os.close(fd)


# -- cgroup v1 ------------------------------------------------------------------------------------

V1_SCOPE = f"kubepods/burstable/pod{UID}/crio-{CID}"


def devices_list(path: Path) -> set[str]:
    return {r.line() for r in parse_devices_list((path / "devices.list").read_text())}


def test_v1_default_allow_container(tree: CgroupTree, nodes: dict[str, Path]) -> None:
    scope = tree.mkdir("devices", V1_SCOPE)
    neighbour = tree.mkdir("devices", f"kubepods/burstable/pod{UID}/crio-{CID_OTHER}")
    targets = [GuardTarget(UID, "Burstable", f"cri-o://{CID}", frozenset({1}), LABEL)]
    guard = guard_for(tree, V1DeviceRules(), targets, nodes, driver=CgroupDriver.CGROUPFS)
    inside, outside = tree.prober(), tree.prober()
    inside.join(scope)
    outside.join(neighbour)

    assert guard.reconcile_once().applied == [LABEL]
    assert devices_list(scope) == {"a *:* rwm"}  # the kernel does not show the exceptions
    assert errnos(inside, nodes, ALL) == GPU1
    assert errnos(outside, nodes, ALL) == UNGUARDED
    assert guard.reconcile_once().unchanged == 1

    targets.clear()
    assert guard.reconcile_once().removed == [LABEL]
    assert errnos(inside, nodes, ALL) == UNGUARDED


def runc_whitelist(scope: Path, extra: list[str]) -> set[str]:
    """Turn the cgroup into what runc makes of a container's: deny all, then allow a list."""
    (scope / "devices.deny").write_text("a")
    for line in RUNC_WHITELIST + extra:
        (scope / "devices.allow").write_text(line)
    return devices_list(scope)


def test_v1_whitelisted_container_without_gpu(tree: CgroupTree, nodes: dict[str, Path]) -> None:
    scope = tree.mkdir("devices", V1_SCOPE)
    original = runc_whitelist(scope, ["c 195:* rwm", f"c {UVM_MAJOR}:0 rw", f"c {CAPS_MAJOR}:1 r"])
    targets = [GuardTarget(UID, "Burstable", CID, None, LABEL)]
    guard = guard_for(tree, V1DeviceRules(), targets, nodes, driver=CgroupDriver.CGROUPFS)
    probe = tree.prober()
    probe.join(scope)
    assert probe.open_errno(nodes["nvidia1"]) == ENXIO  # NVIDIA_VISIBLE_DEVICES=all, in effect

    assert guard.reconcile_once().applied == [LABEL]
    assert devices_list(scope) == set(RUNC_WHITELIST)
    assert errnos(probe, nodes, ALL) == NO_GPU

    (scope / "devices.allow").write_text("c 195:* rwm")  # a runtime update re-applies its list
    assert probe.open_errno(nodes["nvidia1"]) == ENXIO
    report = guard.reconcile_once()
    assert report.reattached == [LABEL]
    assert errnos(probe, nodes, ALL) == NO_GPU

    targets.clear()
    assert guard.reconcile_once().removed == [LABEL]
    assert devices_list(scope) == original  # exactly what the runtime had granted


def test_v1_whitelisted_gpu_container_keeps_its_gpu(tree: CgroupTree, nodes: dict[str, Path]) -> None:
    scope = tree.mkdir("devices", V1_SCOPE)
    original = runc_whitelist(scope, ["c 195:* rwm", "c 195:0 rw", f"c {UVM_MAJOR}:* rwm"])
    targets = [GuardTarget(UID, "Burstable", CID, frozenset({1}), LABEL)]
    guard = guard_for(tree, V1DeviceRules(), targets, nodes, driver=CgroupDriver.CGROUPFS)
    probe = tree.prober()
    probe.join(scope)

    assert guard.reconcile_once().applied == [LABEL]
    granted = devices_list(scope)
    assert {"c 195:1 rwm", "c 195:255 rwm", f"c {UVM_MAJOR}:* rwm"} <= granted
    assert not {"c 195:* rwm", "c 195:0 rw"} & granted
    expected = GPU1 | {"nvidia-cap1": EPERM}  # never granted by the whitelist in the first place
    assert errnos(probe, nodes, ALL) == expected

    targets.clear()
    guard.reconcile_once()
    assert devices_list(scope) == original
