"""Containers made by a real containerd with runc and with crun, on a cgroup v1 node and a
cgroup v2 node (``containerd`` fixture: one cell of the matrix each), seen and acted on by the
agent's own platform code: cgroup resolution, the device guard beside the runtime's own device
rules and across the runtime's ``update``, the freezer beside ``ctr task pause``, the watchdog's
thaw after the agent is SIGKILLed, and the memory guard's kill inside the container's pid
namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.clock import SystemClock
from agent.control.actuators import FreezerActuator, ThrottleTarget
from agent.control.memguard import MemoryGuard, MemoryView, process_uses
from agent.platform.bpf import syscall
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, DeviceRules, NvidiaMajors, Outcome
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.freezer import is_frozen, set_frozen
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import CgroupResolver
from agent.platform.freezejournal import FreezeJournal
from agent.platform.gpu.inventory import ProcessMemory
from agent.platform.procfs import ProcFS
from agent.settings import MemoryQuotaMode
from tests.integration.freezing import AGENT_SCRIPT, wait_for
from tests.runtime import gpuprobe
from tests.runtime.containerd import Container, PrivateContainerd

pytestmark = pytest.mark.privileged

REPO = Path(__file__).resolve().parents[2]
GPUS = gpuprobe.GPUS


def resolver(containerd: PrivateContainerd) -> CgroupResolver:
    return CgroupResolver(containerd.layout(), CgroupDriver.CGROUPFS)


def hierarchy(containerd: PrivateContainerd, v1_controller: str) -> str:
    """Where the agent looks for a v1 controller's files on this cell's node."""
    return v1_controller if containerd.cgroup == "v1" else UNIFIED


def scope(containerd: PrivateContainerd, box: Container, v1_controller: str) -> Path:
    found = resolver(containerd).container_dir(
        box.pod_uid, box.qos, box.id, hierarchy(containerd, v1_controller)
    )
    assert found is not None, f"no {v1_controller} cgroup for {box.cgroup_path}"
    return found


@pytest.fixture
def rules(containerd: PrivateContainerd, request: pytest.FixtureRequest) -> DeviceRules:
    """The agent's device rules for this cell: devices.allow/deny on v1, its program on v2."""
    if containerd.cgroup == "v1":
        return V1DeviceRules(NvidiaMajors())
    v2: BpfDeviceRules = request.getfixturevalue("bpf_rules")
    return v2


@pytest.fixture
def gpu_nodes(containerd: PrivateContainerd) -> tuple[Path, ...]:
    """Host device nodes /dev/nvidia<N> stand-ins (char 195:N; no driver behind them)."""
    return gpuprobe.gpu_nodes(containerd)


def open_gpu(containerd: PrivateContainerd, box: Container, node: Path) -> str:
    """What opening a GPU node in the container gets from the device cgroup: "allowed" (the open
    reaches the kernel, which has no NVIDIA driver here: ENXIO) or "denied" (EPERM), as cat
    itself reports it."""
    verdicts = {"No such device or address": "allowed", "Operation not permitted": "denied"}
    texts = []
    for _ in range(3):
        done = containerd.exec(box, "/bin/cat", str(node))
        texts.append((done.returncode, done.stderr))
        for message, verdict in verdicts.items():
            if f"{node}': {message}" in done.stderr:  # busybox: cat: can't open '<node>': <error>
                return verdict
        # Not cat's answer: ctr lost the output (CI saw an empty stderr) or the exec itself
        # failed on a busy host; the open is harmless to repeat.
        time.sleep(0.2)
    raise AssertionError(f"cat {node} in the container never answered: {texts}")


def mknod_gpu(containerd: PrivateContainerd, box: Container, minor: int) -> str:
    done = containerd.exec(
        box, "/bin/mknod", f"/tmp/gpu{minor}-{time.monotonic_ns()}", "c", "195", str(minor)
    )
    if done.returncode == 0:
        return "allowed"
    assert "Operation not permitted" in done.stderr, done.stderr
    return "denied"


@pytest.mark.parametrize("qos", ["besteffort", "burstable", "guaranteed"])
def test_a_container_resolves_to_its_pod_and_id(containerd: PrivateContainerd, qos: str) -> None:
    box = containerd.run(qos=qos)
    ref = resolver(containerd).container_of_pid(box.pid)
    assert ref is not None and (ref.pod_uid, ref.container_id) == (box.pod_uid, box.id)
    for controller in ("devices", "freezer"):
        where = hierarchy(containerd, controller)
        dirs = resolver(containerd).container_dirs(box.pod_uid, qos, box.id, where)
        assert dirs is not None, f"no {where} dir for {box.cgroup_path}"
        assert str(box.pid) in (dirs.leaf / "cgroup.procs").read_text().split()


def test_the_guard_denies_every_gpu_to_a_container_without_one(
    containerd: PrivateContainerd, rules: DeviceRules, gpu_nodes: tuple[Path, ...]
) -> None:
    # The classic escape: an image with NVIDIA_VISIBLE_DEVICES=all, and the NVIDIA runtime
    # hands every GPU to a container that asked for none.
    box = containerd.run(devices=gpu_nodes)
    assert mknod_gpu(containerd, box, 0) == "allowed"  # the runtime's own rules allow any mknod
    assert rules.ensure(scope(containerd, box, "devices"), DevicePolicy(None), audit=False) is Outcome.APPLIED
    assert [open_gpu(containerd, box, node) for node in gpu_nodes] == ["denied", "denied"]
    made = containerd.workdir / "made-in-container"
    # On v2 the program refuses the mknod too. On v1 the runtime's blanket "c *:* m" cannot be
    # narrowed (the kernel removes exceptions only whole): the node can be made, never opened.
    expected_mknod = "denied" if containerd.cgroup == "v2" else "allowed"
    assert mknod_gpu(containerd, box, 0) == expected_mknod
    if expected_mknod == "allowed":
        assert containerd.exec(box, "/bin/mknod", str(made), "c", "195", "0").returncode == 0
        assert open_gpu(containerd, box, made) == "denied"


def device_programs(scope: Path) -> str:
    """The device programs attached on ``scope`` and each cgroup above it (ids and names):
    what a denial came from, when a test sees one it did not expect."""
    lines: list[str] = []
    for path in [scope, *scope.parents]:
        if not (path / "cgroup.procs").exists():
            break
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ids = syscall.prog_query(fd, syscall.BPF_CGROUP_DEVICE)
        except syscall.BpfSyscallError as err:
            ids, lines = [], [*lines, f"{path}: {err}"]
        finally:
            os.close(fd)
        names = []
        for prog_id in ids:
            try:
                names.append(f"{prog_id}:{syscall.prog_info_by_id(prog_id).name}")
            except syscall.BpfSyscallError:
                names.append(f"{prog_id}:?")
        lines.append(f"{path} (cgroup id {path.stat().st_ino}): {', '.join(names) or 'none'}")
    return "\n".join(lines)


def test_the_guard_narrows_a_container_to_its_gpu_and_outlasts_the_runtimes_update(
    containerd: PrivateContainerd, rules: DeviceRules, gpu_nodes: tuple[Path, ...]
) -> None:
    box = containerd.run(devices=gpu_nodes)  # every GPU, as the NVIDIA runtime hands them out
    assert [open_gpu(containerd, box, node) for node in gpu_nodes] == ["allowed", "allowed"]
    devices = scope(containerd, box, "devices")
    share_of_gpu0 = DevicePolicy(frozenset({0}))
    assert rules.ensure(devices, share_of_gpu0, audit=False) is Outcome.APPLIED
    opened = [open_gpu(containerd, box, node) for node in gpu_nodes]
    if containerd.cgroup == "v2":
        assert opened == ["allowed", "denied"], (opened, device_programs(devices))
    assert opened == ["allowed", "denied"], opened
    # The runtime re-applies the container's resources, its device rules (v1 files, v2 program)
    # among them; on v2 nothing it can set exists here, so it re-applies what it has.
    containerd.update(box, *(("--pids-limit", "100") if containerd.cgroup == "v1" else ()))
    after_update = open_gpu(containerd, box, gpu_nodes[1])
    verdict = rules.ensure(devices, share_of_gpu0, audit=False)
    assert [open_gpu(containerd, box, node) for node in gpu_nodes] == ["allowed", "denied"]
    # What the runtime did is seen either way: the guard's next pass keeps or repairs its rules.
    assert (after_update == "allowed") == (verdict is Outcome.REPAIRED), (after_update, verdict)
    assert verdict in (Outcome.UNCHANGED, Outcome.REPAIRED)


def test_the_freezer_and_ctr_pause_do_not_undo_each_other(
    containerd: PrivateContainerd, tmp_path: Path
) -> None:
    box = containerd.run()
    freezer = scope(containerd, box, "freezer")
    journal = FreezeJournal(tmp_path / "frozen.json")
    actuator = FreezerActuator(journal)
    target = ThrottleTarget("default/pod/main", freezer, None)
    try:
        actuator.freeze(target)  # a duty-cycle slice: frozen, journaled, thawed
        assert is_frozen(freezer) and journal.entries().cgroups == (freezer,)
        actuator.thaw(target)
        assert not is_frozen(freezer)
        containerd.ctr("task", "pause", box.id)  # the runtime pauses through the same file
        assert is_frozen(freezer)
        actuator.freeze(target)
        actuator.thaw(target)  # the agent's slices leave the runtime's pause alone ...
        assert is_frozen(freezer) and containerd.task_status(box.id) == "PAUSED"
        assert journal.entries().cgroups == ()  # ... and so does the watchdog: not journaled
        actuator.release_all()
        assert is_frozen(freezer)
        containerd.ctr("task", "resume", box.id)
        assert not is_frozen(freezer)
        actuator.freeze(target)  # resumed: throttled again
        assert is_frozen(freezer) and journal.entries().cgroups == (freezer,)
        actuator.release(target)
        assert not is_frozen(freezer) and journal.entries().cgroups == ()
    finally:
        set_frozen(freezer, False)
    assert containerd.exec(box, "/bin/true").returncode == 0


def test_the_watchdog_thaws_a_runtime_container_after_the_agent_is_killed(
    containerd: PrivateContainerd, tmp_path: Path
) -> None:
    box = containerd.run()
    freezer = scope(containerd, box, "freezer")
    journal = tmp_path / "state" / "frozen.json"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_SCRIPT, str(journal), str(freezer)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "agent.log").open("w"),
        text=True,
        cwd=REPO,
    )
    try:
        assert agent.stdout is not None
        assert len(agent.stdout.readline().split()) == 2, (tmp_path / "agent.log").read_text()
        assert is_frozen(freezer)
        agent.kill()
        killed_at = time.monotonic()
        assert wait_for(lambda: not is_frozen(freezer), timeout_s=2.0)
        elapsed = time.monotonic() - killed_at
    finally:
        agent.kill()
        agent.wait()
        set_frozen(freezer, False)
    assert elapsed < 1.0, f"thawed only {elapsed:.3f} s after the kill"
    assert containerd.exec(box, "/bin/true").returncode == 0


def in_container_pids(containerd: PrivateContainerd, box: Container) -> dict[int, int]:
    """{host pid: pid inside the container's pid namespace} of the container's processes."""
    procs = scope(containerd, box, "freezer") / "cgroup.procs"
    found: dict[int, int] = {}
    for pid in map(int, procs.read_text().split()):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                found[pid] = int(line.split()[-1])
    return found


def test_the_memory_guard_kills_the_process_over_quota_inside_the_pid_namespace(
    containerd: PrivateContainerd,
) -> None:
    box = containerd.run()
    containerd.exec(box, "/bin/sleep", "600", detach=True)
    assert wait_for(lambda: len(in_container_pids(containerd, box)) == 2, 5.0)
    pids = in_container_pids(containerd, box)
    assert pids[box.pid] == 1  # the container's init: pid 1 in its namespace
    (worker,) = [pid for pid in pids if pid != box.pid]
    assert pids[worker] != worker  # NVML reports the host pid; the container sees another
    guard = MemoryGuard(mode=MemoryQuotaMode.KILL, procfs=ProcFS(), clock=SystemClock())
    uses = process_uses([ProcessMemory(worker, 300 << 20), ProcessMemory(box.pid, 10 << 20)], ProcFS())
    (action,) = guard.check([MemoryView(f"default/{box.id[:8]}/main", None, 256, uses)])
    assert action.action == f"killed pid {worker}"
    assert wait_for(lambda: worker not in in_container_pids(containerd, box), 5.0)
    assert containerd.task_status(box.id) == "RUNNING"  # only the process over quota
