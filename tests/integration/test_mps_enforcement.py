"""Sharing mode mps on the simulated GPU engine with real containers: a real agent runs the
GPU's MPS control daemon (the simulator's stand-in, a real process), hands each share its
MPS limits at Allocate over real gRPC, and the GPU server runs the containers' real workload
processes as MPS clients within those limits. A gpu_burn-like queue, which freezing cannot
hold (test_enforcement.py), is held here. Also: the daemon killed and restarted, a missing
daemon binary (the freezer holds the shares), and driver memory limits (an allocation over
the quota fails; nothing is killed).

What a loaded 2-core host cannot break is asserted here: the limits handed out, who holds
each share (status), who is frozen and thawed, and throughputs only where the GPU server's
own MPS limits bound them. How accurately each share is held is asserted in virtual time, on
the same scenarios: tests/unit/test_shares_virtual.py.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.emulators.enforcednode import (
    EnforcedNode,
    enforced_node,
    frozen_then_thawed,
    pod_manifest,
    wait_for,
)
from agent.platform.gpu.mpspartition import effective_share
from agent.surfaces.statusclient import fetch_status
from tests.integration.cgroup_trees import real_layout
from tests.integration.mpstenants import start_tenant

pytestmark = pytest.mark.privileged

TENANT_UID = 1000
MEASURE_S = 3.0
HELD_S = 30.0  # the longest a share is given to be seen held on a loaded host
SMS = 132  # the simulated H100's SMs: MPS limits are whole TPCs of them
AGENT = ("--device-guard", "off", "--no-ioctl-tracing", "--mps-advisory-limits")


@pytest.fixture
def mps_node(short_dir: Path) -> Iterator[EnforcedNode]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    with enforced_node(short_dir, agent_args=(*AGENT, "--sharing-mode", "mps")) as node:
        yield node


def status(node: EnforcedNode) -> dict[str, Any]:
    return fetch_status(node.state_dir / "status.sock")


def rows(node: EnforcedNode) -> dict[str, dict[str, Any]]:
    return {c["pod"]: c for c in status(node)["gpus"][0]["containers"]}


def test_burn_is_held_by_mps_limits_handed_out_at_allocate(mps_node: EnforcedNode) -> None:
    small = mps_node.run_pod("small", 30, extra=("--pattern", "burn"))
    large = mps_node.run_pod("large", 60, extra=("--pattern", "burn"))
    envs = dict(mps_node.responses["small"].envs)
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "29"  # 38 of 132 SMs: whole TPCs within 30 %
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    mounts = {m.container_path: m.host_path for m in mps_node.responses["small"].mounts}
    pipe = Path(mounts[envs["CUDA_MPS_PIPE_DIRECTORY"]])
    assert (pipe / "control").exists()  # the GPU's daemon serves that pipe directory
    used_small, used_large = mps_node.utilization([small, large], MEASURE_S)
    # The GPU server runs each client within its limit, however loaded the host: the 30's
    # burn gets at most its 38 SMs (time-sliced, two burns would get half the GPU each).
    assert 0 < used_small <= effective_share(29, SMS) * 100 + 3 < used_large, (used_small, used_large)
    gpu = status(mps_node)["gpus"][0]
    assert gpu["sharing"] == "mps" and gpu["mpsDaemon"]["state"] == "running"
    held = wait_for(lambda: len(rows(mps_node)) == 2 and rows(mps_node), 10, "both pods in status")
    assert held["small"]["computeHeldBy"] == "mps+freezer"
    assert "38 SMs" in held["small"]["computeDetail"]
    assert held["large"]["memoryHeldBy"] == "mps"
    metrics = mps_node.metrics()
    assert re.search(r'^vcuda_mps_daemon_up\{gpu="0",node="sim-node",uuid="GPU-[^"]+"\} 1\.0$', metrics, re.M)
    assert 'compute="mps+freezer"' in metrics


def test_a_killed_daemon_is_restarted_and_new_pods_get_mps_again(mps_node: EnforcedNode) -> None:
    first = mps_node.run_pod("first", 30, extra=("--pattern", "burn"))
    daemon = status(mps_node)["gpus"][0]["mpsDaemon"]
    os.kill(daemon["pid"], signal.SIGKILL)
    # Its clients go with their server, as CUDA clients of a dead MPS server do.
    assert first.proc.wait(timeout=10) != 0

    def restarted() -> dict[str, Any] | None:
        state = status(mps_node)["gpus"][0]["mpsDaemon"]
        return state if state["state"] == "running" and state["restarts"] == 1 else None

    again = wait_for(restarted, 15, "the daemon restarted")
    assert again["pid"] != daemon["pid"]
    mps_node.run_pod("second", 30, extra=("--pattern", "burn"))
    row = wait_for(lambda: rows(mps_node).get("second"), 10, "the second pod in status")
    assert row["computeHeldBy"] == "mps+freezer"


def test_by_default_a_tenant_that_lifts_its_own_mps_limit_is_held_by_the_freezer(short_dir: Path) -> None:
    # The variable "only further constrains" the daemon's 100 %, so a tenant that
    # sets it to 100 in its own env ran at 33 % beside fixed 50 and fixed 40. By default no MPS
    # limit a tenant can lift is used: no daemon, the freezer holds every share, status says why.
    real_layout()
    args = ("--device-guard", "off", "--no-ioctl-tracing", "--sharing-mode", "mps")
    with enforced_node(short_dir, agent_args=args) as node:
        cheat = node.run_pod("cheat", 10, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
        fixed50 = node.run_pod("fixed50", 50)
        fixed40 = node.run_pod("fixed40", 40)
        assert not any(k.startswith("CUDA_MPS") for k in node.responses["cheat"].envs)
        gpu = status(node)["gpus"][0]
        assert gpu["sharing"] == "freezer" and "advisory" in gpu["sharingReason"], gpu
        assert gpu["mpsDaemon"] is None or gpu["mpsDaemon"]["state"] == "stopped"
        # Held by the freezer at its grant (10 %, not the 33 % it takes unheld beside the two):
        # frozen and thawed for its turns. The figures: test_shares_virtual.py.
        held = wait_for(
            lambda: (r := rows(node).get("cheat")) and r["throttled"] and r, HELD_S, "the 10 held"
        )
        assert (held["targetPercent"], held["computeHeldBy"]) == (10, "freezer"), held
        frozen_then_thawed(cheat.cgroup, HELD_S, "the tenant that lifted its limit")
        assert all(b.proc.poll() is None for b in (cheat, fixed50, fixed40))
        assert re.search(
            r'^vcuda_mps_limits_advisory\{gpu="0",node="sim-node",uuid="GPU-[^"]+"\} 0\.0$',
            node.metrics(),
            re.M,
        )


def test_on_an_mps_v3_driver_the_tenant_that_lifts_its_env_stays_at_its_grant(short_dir: Path) -> None:
    # The same cheat on a driver whose daemon binds limits to cgroups (r615+/R620, simulated;
    # unverified on hardware): the agent detects it, uses MPS without being asked, and the
    # tenant's own 100 % does not raise the namespace the agent bound to its pod's cgroup.
    # The pods run as uid 1000: one of the daemon's uid (root) is not trusted to its
    # namespace (tests/integration/test_mps_v3.py).
    real_layout()
    args = ("--device-guard", "off", "--no-ioctl-tracing", "--sharing-mode", "mps")
    with enforced_node(short_dir, gpu_args=("--driver-mps-v3",), agent_args=args) as node:
        lifted = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
        cheat = start_tenant(node, "cheat", 10, user=TENANT_UID, queue=16, kernel_ms=10, env=lifted)[0]
        fixed50 = start_tenant(node, "fixed50", 50, user=TENANT_UID, queue=16, kernel_ms=10)[0]
        fixed40 = start_tenant(node, "fixed40", 40, user=TENANT_UID, queue=16, kernel_ms=10)[0]
        trusted = dict.fromkeys(("cheat", "fixed50", "fixed40"), "mps+freezer")
        wait_for(
            lambda: {pod: row["computeHeldBy"] for pod, row in rows(node).items()} == trusted,
            10,
            "the three trusted to their namespaces",
        )
        assert node.responses["cheat"].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
        gpu = status(node)["gpus"][0]
        assert gpu["sharing"] == "mps" and "(enforceable)" in gpu["sharingReason"], gpu
        assert "MPS v3 namespaces: yes" in gpu["sharingReason"]
        assert "unverified on hardware" in gpu["sharingReason"]
        used = node.utilization([cheat, fixed50, fixed40], MEASURE_S)
        # Its namespace's 12 of 132 SMs (whole TPCs within 10 %) bound it in the GPU server,
        # whatever its env says and however loaded the host; the others' figures (and the 10's
        # exactly): test_shares_virtual.py.
        assert 0 < used[0] <= effective_share(10, SMS) * 100 + 3, used
        assert used[1] > 0 and used[2] > 0, used
        assert re.search(
            r'^vcuda_mps_limits_advisory\{gpu="0",node="sim-node",uuid="GPU-[^"]+"\} 0\.0$',
            node.metrics(),
            re.M,
        )


def test_clients_of_two_user_ids_are_reported_not_left_waiting_in_silence(mps_node: EnforcedNode) -> None:
    # MPS runs one server per user id: a client of another uid waits until the running
    # server's clients are done. The agent sees the uids of each share's processes and says so.
    sim = mps_node.runtime.sim_state_dir
    for path in (mps_node.workdir, sim):
        path.chmod(0o755)  # the uid-1000 client must reach the GPU server's socket
    (sim / "gpu.sock").chmod(0o777)
    mps_node.run_pod("root", 30)
    admission = mps_node.node.run_pod(pod_manifest("tenant", 30, 1024, {}))
    # The system's Python and the standard library only: a checkout (and its venv) may sit
    # where uid 1000 cannot read (mktemp -d is 0700).
    client = [str(Path(sys.base_exec_prefix) / "bin" / "python3"), "-c", _MPS_CLIENT, str(sim / "gpu.sock")]
    waiting = mps_node.start_container(admission, user=TENANT_UID, command=client, wait=False)
    reason = wait_for(
        lambda: (
            "user ids 0, 1000" in status(mps_node)["gpus"][0]["sharingReason"]
            and status(mps_node)["gpus"][0]["sharingReason"]
        ),
        15,
        "the mixed user ids in status",
    )
    assert "the others wait" in reason
    # Alive and without a context: it waits for root's server, as on a real node.
    assert waiting.proc.poll() is None and not mps_node.on_gpu(waiting)

    # Events are posted after status changes (a queue of their own): wait for both.
    def mixed_pods() -> set[str]:
        events = mps_node.api.events()
        return {e["involvedObject"]["name"] for e in events if e.get("reason") == "GPUMpsUsersMixed"}

    wait_for(lambda: mixed_pods() == {"root", "tenant"}, 5, "a GPUMpsUsersMixed Event on each pod")


_MPS_CLIENT = """
import json, os, socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
sock.sendall(json.dumps({"op": "open", "gpu": 0, "share": 100, "mps_pipe": pipe}).encode() + b"\\n")
sock.makefile().readline()  # answered once root's server has no clients
time.sleep(3600)
"""


def test_without_a_daemon_binary_the_freezer_holds_and_status_says_why(short_dir: Path) -> None:
    real_layout()
    args = (*AGENT, "--sharing-mode", "mps", "--mps-control", "/nonexistent/nvidia-cuda-mps-control -f")
    with enforced_node(short_dir, agent_args=args) as node:
        node.run_pod("plain", 30)
        assert not any(k.startswith("CUDA_MPS") for k in node.responses["plain"].envs)
        gpu = status(node)["gpus"][0]
        assert gpu["sharing"] == "freezer" and "/nonexistent/nvidia-cuda-mps-control" in gpu["sharingReason"]
        row = wait_for(lambda: rows(node).get("plain"), 10, "the container in status")
        assert row["computeHeldBy"] == "freezer" and "not found" in row["computeDetail"]
        assert "no MPS" in node.agent_log()


def test_over_a_driver_memory_limit_an_allocation_fails_and_nothing_is_killed(short_dir: Path) -> None:
    real_layout()
    with enforced_node(short_dir, gpu_args=("--driver-memory-limits",), agent_args=AGENT) as node:
        grower = node.run_pod(
            "grower",
            30,
            memory_mib=1024,
            workload_mib=512,
            extra=("--grow-to-mib", "2048", "--grow-after", "2"),
        )
        wait_for(lambda: rows(node).get("grower", {}).get("memoryHeldBy") == "driver", 10, "the driver limit")
        code = grower.proc.wait(timeout=20)
        assert code == 1  # CUDA's out-of-memory ended the program; not a signal
        status_doc = status(node)
        assert not any("killed" in a["action"] for a in status_doc["recentActions"])
        assert "killed" not in node.agent_log()
