"""The device gate on a real runtime: rules on the pod's cgroup, put there the moment kubelet
makes it, hold for the container from its first instruction; a container that the runtime
hands a GPU outside its pod's set never opens it (cgroup v2: the open is refused; cgroup v1:
the kernel refuses the runtime's allow line, so the container does not start)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.control.podgate import PodGate
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, DeviceRules
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.paths import qos_dir_names
from tests.runtime.containerd import PrivateContainerd, new_pod_uid
from tests.runtime.gpuprobe import controller, gpu_nodes, make_pod_cgroup, probe_result, resolver, start_probe

pytestmark = pytest.mark.privileged


@pytest.fixture
def gate_rules(containerd: PrivateContainerd, request: pytest.FixtureRequest) -> DeviceRules:
    if containerd.cgroup == "v1":
        return V1DeviceRules(deny_access="rw")
    rules: DeviceRules = request.getfixturevalue("bpf_rules")
    return rules


@contextmanager
def running_gate(
    containerd: PrivateContainerd, rules: DeviceRules, policies: dict[str, DevicePolicy | None]
) -> Iterator[PodGate]:
    """A gate on this cell's kubepods, whose parents exist as kubelet makes them at start."""
    root = resolver(containerd).kubepods_root(controller(containerd))
    for name in qos_dir_names(CgroupDriver.CGROUPFS):
        (root / name).mkdir(parents=True, exist_ok=True)
    # Pods of other tests (kubepods is the host's, shared by every containerd here) are exempt:
    # a gate that denied them their GPUs failed the matrix's containers (CI).
    gate = PodGate(policies.get, resolver(containerd), rules, interval_s=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=gate.run, args=(stop,), name="device-gate", daemon=True)
    thread.start()
    try:
        assert gate.watching.wait(10), "the gate did not start watching kubepods"
        yield gate
    finally:
        stop.set()
        thread.join(5)
        assert not thread.is_alive(), "the gate did not stop: it would go on gating other tests' pods"


def test_a_container_without_gpus_never_opens_one_it_is_handed(
    containerd: PrivateContainerd, gate_rules: DeviceRules, tmp_path: Path
) -> None:
    # NVIDIA_VISIBLE_DEVICES=all on a pod that asked for no GPU: the runtime hands it every GPU
    # and the container opens GPU 1 from its first instruction on, for a second.
    uid = new_pod_uid()
    with running_gate(containerd, gate_rules, {uid: DevicePolicy(None)}):
        make_pod_cgroup(containerd, uid)  # kubelet, before the sandbox and the containers
        try:
            nodes = gpu_nodes(containerd)  # in the container at the host's path
            start_probe(containerd, uid, nodes, str(nodes[1]), out=tmp_path / "out", seconds=1.0)
        except RuntimeError as err:  # v1: the runtime's "c 195:1 rwm" allow line is refused
            assert containerd.cgroup == "v1", err
            assert "operation not permitted" in str(err).lower(), err
            return
        result = probe_result(tmp_path / "out", 20)
    assert result.attempts > 10
    assert result.allowed == 0, (
        f"{result.allowed} of {result.attempts} opens succeeded ({result.window_ms} ms)"
    )


def test_a_gpu_pod_keeps_its_gpu_and_gets_no_other(
    containerd: PrivateContainerd, gate_rules: DeviceRules, tmp_path: Path
) -> None:
    uid = new_pod_uid()
    nodes = gpu_nodes(containerd)
    with running_gate(containerd, gate_rules, {uid: DevicePolicy(frozenset({0}))}):
        make_pod_cgroup(containerd, uid)
        box = start_probe(containerd, uid, nodes[:1], str(nodes[0]), out=tmp_path / "out", seconds=0.3)
        result = probe_result(tmp_path / "out", 20)
        assert result.attempts > 3 and result.allowed == result.attempts  # its own GPU, from the start
        made = "/tmp/nvidia1"  # another GPU's node, made inside (v1 keeps "m": the open is what counts)
        done = containerd.exec(box, "/bin/mknod", made, "c", "195", "1")
        if done.returncode == 0:
            assert "Operation not permitted" in containerd.exec(box, "/bin/cat", made).stderr
        else:
            assert containerd.cgroup == "v2" and "Operation not permitted" in done.stderr, done.stderr


def test_a_plain_container_in_a_gated_pod_starts(
    containerd: PrivateContainerd, gate_rules: DeviceRules
) -> None:
    # The pod's deny lines must leave the runtime's own rules (runc's "c *:* m" on v1) possible.
    uid = new_pod_uid()
    with running_gate(containerd, gate_rules, {uid: DevicePolicy(None)}) as gate:
        make_pod_cgroup(containerd, uid)
        box = containerd.run(pod_uid=uid)
        assert containerd.exec(box, "/bin/true").returncode == 0
        assert gate.stats().gated >= 1 and gate.stats().errors == 0
