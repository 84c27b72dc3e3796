"""runc containers made by a real containerd, on this machine's cgroup layout (v1 controllers
with a v2 hierarchy beside them: hybrid), seen and acted on by the agent's own platform code:
the cgroup resolution, the device guard's v1 rules (and what ``runc update`` does to them), and
the freezer beside ``ctr task pause``."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, NvidiaMajors, Outcome
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.freezer import is_frozen, set_frozen
from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.paths import CgroupResolver
from tests.runtime.containerd import Container, PrivateContainerd

pytestmark = pytest.mark.privileged


def resolver() -> CgroupResolver:
    return CgroupResolver(detect_layout(), CgroupDriver.CGROUPFS)


def open_gpu(containerd: PrivateContainerd, container: Container, minor: int) -> str:
    """What opening /dev/nvidia<minor> in the container gets from the devices cgroup: "allowed"
    (the open reaches the kernel, which has no NVIDIA driver here: ENXIO) or "denied" (EPERM).
    runc's rules allow mknod of any device (c *:* m), so the node is made first."""
    node = f"/tmp/nvidia{minor}-{secrets.token_hex(4)}"
    made = containerd.exec(container, "/bin/mknod", node, "c", "195", str(minor))
    assert made.returncode == 0, made.stderr
    text = containerd.exec(container, "/bin/cat", node).stderr
    if "Operation not permitted" in text:
        return "denied"
    assert "No such device" in text, text
    return "allowed"


def grant_all_gpus(devices: Path) -> None:
    """What the NVIDIA container runtime's hook does for a container it hands GPUs to."""
    (devices / "devices.allow").write_text("c 195:* rwm")


@pytest.mark.parametrize("qos", ["besteffort", "burstable", "guaranteed"])
def test_a_runc_container_resolves_to_its_pod_and_id(containerd: PrivateContainerd, qos: str) -> None:
    box = containerd.run(runtime_binary="runc", qos=qos)
    ref = resolver().container_of_pid(box.pid)
    assert ref is not None and (ref.pod_uid, ref.container_id) == (box.pod_uid, box.id)
    for controller in ("devices", "freezer"):
        dirs = resolver().container_dirs(box.pod_uid, qos, box.id, controller)
        assert dirs is not None, f"no {controller} dir for {box.cgroup_path}"
        assert str(box.pid) in (dirs.leaf / "cgroup.procs").read_text().split()


def test_the_device_guard_narrows_a_runc_container_to_its_gpu_and_outlasts_runc_update(
    containerd: PrivateContainerd,
) -> None:
    box = containerd.run(runtime_binary="runc")
    devices = resolver().container_dir(box.pod_uid, box.qos, box.id, "devices")
    assert devices is not None
    assert open_gpu(containerd, box, 0) == "denied"  # runc alone grants no NVIDIA device
    grant_all_gpus(devices)
    assert open_gpu(containerd, box, 1) == "allowed"
    rules = V1DeviceRules(NvidiaMajors())
    share_of_gpu0 = DevicePolicy(frozenset({0}))
    assert rules.ensure(devices, share_of_gpu0, audit=False) is Outcome.APPLIED
    assert (open_gpu(containerd, box, 0), open_gpu(containerd, box, 1)) == ("allowed", "denied")
    # runc update re-applies the container's resources, its device rules among them.
    containerd.update(box, "runc", "--memory", str(512 << 20))
    after_update = open_gpu(containerd, box, 1)
    verdict = rules.ensure(devices, share_of_gpu0, audit=False)
    assert (open_gpu(containerd, box, 0), open_gpu(containerd, box, 1)) == ("allowed", "denied")
    # What runc did is recorded either way: the guard's next pass keeps or repairs its rules.
    assert (after_update == "allowed") == (verdict is Outcome.REPAIRED), (after_update, verdict)


def test_the_freezer_and_ctr_pause_do_not_undo_each_other(containerd: PrivateContainerd) -> None:
    box = containerd.run(runtime_binary="runc")
    freezer = resolver().container_dir(box.pod_uid, box.qos, box.id, "freezer")
    assert freezer is not None
    set_frozen(freezer, True)
    assert is_frozen(freezer) and _state(box.pid) in {"D", "T"}  # v1 frozen tasks sleep in the kernel
    set_frozen(freezer, False)
    assert not is_frozen(freezer)
    containerd.ctr("task", "pause", box.id)
    assert is_frozen(freezer)  # runc pauses through the same freezer file
    containerd.ctr("task", "resume", box.id)
    assert not is_frozen(freezer)
    assert containerd.exec(box, "/bin/true").returncode == 0


def _state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"
