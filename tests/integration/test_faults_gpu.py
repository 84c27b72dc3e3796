"""Faults under a real agent process on an enforced simulated node (real cgroups, real
workloads, the real watchdog): an NVML call that hangs for seconds, and a full disk under
the freeze journal. What is asserted is what the kernel and the agent's surfaces show:
cgroup freeze state, the journal file, the status socket, /metrics, the device plugin."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen, pod_manifest, wait_for
from agent.emulators.pods import CORE_RESOURCE
from agent.platform.gpu.inventory import CALL_PROCESS_SAMPLES
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.surfaces.statusclient import fetch_status
from tests.integration.cgroup_trees import real_layout
from tests.integration.kubecluster import metric

pytestmark = pytest.mark.privileged

T = TypeVar("T")
AGENT_ARGS = ("--device-guard", "off", "--no-ioctl-tracing")
HANG_S = 6.0
DEADLINE_S = 2.0  # agent/platform/gpu/guarded.py
BOUND_S = 1.0  # the most the status endpoint, /metrics or the device plugin may take meanwhile
PERIOD_S = 0.25  # the control period (default)


def timed(what: str, call: Callable[[], T]) -> T:
    started = time.monotonic()
    result = call()
    took = time.monotonic() - started
    assert took < BOUND_S, f"{what} took {took:.2f} s while the fault lasted"
    return result


def status(node: EnforcedNode) -> dict[str, Any]:
    return timed("the status endpoint", lambda: fetch_status(node.state_dir / "status.sock", timeout=5))


def scrape(node: EnforcedNode) -> str:
    return timed("GET /metrics", node.metrics)


def threads(pid: int) -> int:
    found = re.search(r"^Threads:\s+(\d+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found, "no thread count in /proc/<pid>/status"
    return int(found[1])


def find_row(doc: dict[str, Any], pod: str) -> dict[str, Any] | None:
    """The pod's container row (None until the controller has it)."""
    rows = [c for g in doc["gpus"] for c in g["containers"] if c["pod"] == pod]
    assert len(rows) <= 1, f"{pod}: {len(rows)} status rows"
    return rows[0] if rows else None


def row(doc: dict[str, Any], pod: str) -> dict[str, Any]:
    found = find_row(doc, pod)
    assert found is not None, f"{pod}: no status row"
    return found


def test_an_nvml_call_that_hangs_degrades_its_gpu_and_stalls_nothing_else(short_dir: Path) -> None:
    real_layout()
    with enforced_node(short_dir, "2xH100-80GB", agent_args=AGENT_ARGS) as node:
        calm = node.run_pod("calm", 60)
        stuck = node.run_pod("stuck", 60)
        assert calm.gpu != stuck.gpu, "60 + 60 cores cannot share one GPU"
        wait_for(lambda: frozen(calm.cgroup), 10, "calm held by its duty cycle")
        wait_for(lambda: frozen(stuck.cgroup), 10, "stuck held by its duty cycle")
        plugin = node.kubelet.plugins[CORE_RESOURCE]
        all_ids = len(plugin.healthy_ids())
        threads_before = threads(node.agent.pid)
        gpu = str(stuck.gpu)

        sim_event = [sys.executable, "-m", "agent", "sim-event", "--gpu", gpu, "--hang", str(HANG_S)]
        sim_event += ["--call", CALL_PROCESS_SAMPLES, "--sim-state-dir", str(node.runtime.sim_state_dir)]
        injected = time.monotonic()
        subprocess.run(sim_event, check=True, capture_output=True, timeout=30)
        posted = time.monotonic()
        start = scrape(node)

        # Until shortly before the hang ends (then the GPU recovers and is held again).
        degraded_at: float | None = None
        most_threads = 0
        admitted = False
        while time.monotonic() < posted + HANG_S - 0.7:
            doc = status(node)
            timed("GetDevicePluginOptions", lambda: plugin.stub.GetDevicePluginOptions(pb.Empty(), timeout=5))
            most_threads = max(most_threads, threads(node.agent.pid))
            assert len(plugin.healthy_ids()) == all_ids, "a degraded GPU stays Healthy for kubelet"
            reason = doc["gpus"][stuck.gpu]["degraded"]
            assert doc["gpus"][calm.gpu]["degraded"] is None
            if reason is not None and degraded_at is None:
                degraded_at = time.monotonic()
                assert CALL_PROCESS_SAMPLES in reason
                # Fail safe: the stale GPU's container is released (thawed, not held).
                wait_for(lambda: not frozen(stuck.cgroup), 0.5, "stuck thawed once its GPU is degraded")
                assert row(doc, "stuck")["throttled"] is False
                text = scrape(node)
                assert metric(text, "vcuda_gpu_degraded", gpu=gpu) == 1
                assert metric(text, "vcuda_gpu_degraded", gpu=str(calm.gpu)) == 0
            elif degraded_at is not None:
                assert not frozen(stuck.cgroup), "a container on a degraded GPU was frozen"
            if degraded_at is not None and not admitted:
                # Allocate (GetPreferredAllocation, Allocate, PreStart) through the kubelet emulator.
                timed("admitting a pod", lambda: node.node.run_pod(pod_manifest("late", 10, 512, {})))
                admitted = True
            time.sleep(0.05)
        end = scrape(node)
        window = time.monotonic() - posted

        assert degraded_at is not None, "the GPU was never reported degraded"
        # The hang began between `injected` and `posted`; the status may lag a control period.
        assert injected + DEADLINE_S <= degraded_at <= posted + DEADLINE_S + 1.0
        assert admitted
        # The control loop kept its period (a loop that waited out one deadline would lose 8 of
        # the ~21 periods), and kept holding the other GPU's container.
        periods = metric(end, "vcuda_control_loop_duration_seconds_count")
        periods_then = metric(start, "vcuda_control_loop_duration_seconds_count")
        assert periods is not None and periods_then is not None
        assert periods - periods_then >= 0.8 * window / PERIOD_S, (
            f"{periods - periods_then} periods in {window:.1f} s"
        )
        freezes = metric(end, "vcuda_container_throttle_actions_total", pod="calm")
        freezes_then = metric(start, "vcuda_container_throttle_actions_total", pod="calm")
        assert freezes is not None and freezes_then is not None and freezes > freezes_then + 1
        # One stuck thread for the GPU at most, not one per call: what a pile-up would add
        # (4 reads a second) dwarfs the few short-lived HTTP and gRPC handler threads.
        assert most_threads <= threads_before + 4, (threads_before, most_threads)

        # The call returns: the GPU recovers, and its container is held again.
        wait_for(lambda: status(node)["gpus"][stuck.gpu]["degraded"] is None, 3, "the GPU recovered")
        assert time.monotonic() - injected >= HANG_S - 0.1, "recovered before the hang ended"
        text = scrape(node)
        assert metric(text, "vcuda_gpu_degraded", gpu=gpu) == 0
        assert metric(text, "vcuda_gpu_call_timeouts_total", gpu=gpu, call=CALL_PROCESS_SAMPLES) == 1
        wait_for(lambda: frozen(stuck.cgroup), 10, "stuck held by its duty cycle again")
        log = node.agent_log()
        assert f"GPU {gpu} degraded: {CALL_PROCESS_SAMPLES} has not returned" in log
        assert f"GPU {gpu} recovered: {CALL_PROCESS_SAMPLES} returned after" in log


@contextmanager
def tiny_tmpfs(path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted at ``path`` (the agent's state dir) for the test's life."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # a process still had it open


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last block; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    with pytest.raises(OSError) as full:
        (directory / "probe").write_text("x")
    assert full.value.errno == errno.ENOSPC
    return filler


def journaled(node: EnforcedNode) -> set[str]:
    path = node.state_dir / "frozen.json"
    return set(json.loads(path.read_text())["cgroups"]) if path.exists() else set()


def never_frozen(cgroup: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not frozen(cgroup), f"{cgroup} frozen while the freeze journal cannot list it"
        time.sleep(0.01)


def frozen_and_journaled(node: EnforcedNode, cgroup: Path) -> bool:
    """Frozen now, and then the journal lists it (it is added before the freeze and leaves
    only when the container is released, which these held containers are not)."""
    if not frozen(cgroup):
        return False
    assert str(cgroup) in journaled(node), f"{cgroup} frozen without its journal entry"
    return True


def journal_problem(node: EnforcedNode, pod: str) -> str | None:
    doc = status(node)
    found = find_row(doc, pod)
    problem = found["problem"] if found else None
    if doc["agent"]["freezeJournal"] == "ok" or not problem or "No space left on device" not in problem:
        return None
    return str(problem)


def test_a_full_disk_under_the_freeze_journal_skips_freezes_and_strands_nothing(short_dir: Path) -> None:
    real_layout()
    with tiny_tmpfs(short_dir / "agent-state"), enforced_node(short_dir, agent_args=AGENT_ARGS) as node:
        filler = fill(node.state_dir)
        first = node.run_pod("first", 20)  # busy: the controller wants it held at 20 %
        # The freeze is skipped, not done without its entry: the container runs unthrottled.
        problem = wait_for(lambda: journal_problem(node, "first"), 10, "the journal problem in status")
        assert "cannot write the freeze journal" in problem
        assert row(status(node), "first")["throttled"] is True  # held on paper, not frozen
        never_frozen(first.cgroup, 4)
        assert metric(scrape(node), "vcuda_freeze_journal_writable") == 0
        log = node.agent_log()
        assert (
            "No space left on device" in log and "it runs unthrottled until the journal can be written" in log
        )

        filler.unlink()  # space returns: freezing resumes, each freeze with its entry first
        wait_for(lambda: frozen_and_journaled(node, first.cgroup), 10, "first frozen with its journal entry")
        wait_for(lambda: status(node)["agent"]["freezeJournal"] == "ok", 5, "the journal ok in status")
        assert metric(scrape(node), "vcuda_freeze_journal_writable") == 1

        # Full again: "first" is in the journal and stays held; a newcomer is not frozen.
        fill(node.state_dir)
        second = node.run_pod("second", 20)
        wait_for(lambda: journal_problem(node, "second"), 10, "second's journal problem in status")
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            frozen_and_journaled(node, first.cgroup)
            assert not frozen(second.cgroup), "second frozen while the journal cannot list it"
            time.sleep(0.01)

        # SIGKILL while "first" is frozen and the disk is still full: the watchdog thaws it.
        wait_for(lambda: frozen_and_journaled(node, first.cgroup), 5, "first frozen")
        node.agent.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        node.agent.wait()
        wait_for(lambda: not frozen(first.cgroup) and not frozen(second.cgroup), 1.0, "everything thawed")
        assert time.monotonic() - killed <= 1.0
