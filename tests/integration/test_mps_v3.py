"""MPS v3 (r615+/R620) on the simulated node: the agent detects it with the documented probe,
runs the daemon with ``-p 3``, gives each share a namespace bound to its container's cgroup
(real cgroups here), and so the cheat of the enforcement benchmark (a tenant with a 10-core
grant that sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 beside a fixed 50 and a fixed 40)
stays at its grant; a tenant that reaches the control socket cannot rebind itself. On a
driver without v3 nothing changes. Unverified on hardware: the stand-in daemon models what
NVIDIA documents plus the assumptions in agent/platform/gpu/sim/mpsnamespaces.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.control.mpssharing import MpsSharing
from agent.domain.ledger import Assignment
from agent.domain.requests import ResolvedRequest
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen_then_thawed, wait_for
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.mpspartition import effective_share
from agent.platform.gpu.sim.mpsdaemon import send_commands
from agent.platform.mpsv3 import MpsCapability, detect, namespace_name, probe_v3
from agent.settings import SharingMode, SharingSettings
from agent.surfaces.statusclient import fetch_status
from tests.integration.cgroup_trees import CgroupTree, cgroup_tree, real_layout
from tests.integration.mpstenants import start_tenant
from tests.integration.test_gpu_server import GpuServerProcess, running_gpu_server, sim_command

SMS = 132
TENANT_UID = 1000
SYSTEM_PYTHON = str(Path(sys.base_exec_prefix) / "bin" / "python3")

# Waits for a line on stdin (the test moves it into its cgroup first), opens a context with
# the share its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE would say, prints the reply, holds it until
# stdin closes.
CLIENT = """
import json, socket, sys
sys.stdin.readline()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
req = {"op": "open", "gpu": 0, "share": float(sys.argv[3]), "mps_pipe": sys.argv[2]}
sock.sendall(json.dumps(req).encode() + b"\\n")
print(sock.makefile().readline().strip(), flush=True)
sys.stdin.readline()
"""


def daemon_command(server: GpuServerProcess) -> list[str]:
    return sim_command("sim-mps-control", "-f", "--sim-state-dir", str(server.root.root))


def gpus_of(server: GpuServerProcess) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(
            g.index, g.uuid, "NVIDIA H100 80GB HBM3", 81559, g.index, f"00000000:{0x18 + g.index:02X}:00.0", 0
        )
        for g in server.root.read_node().gpus
    )


@pytest.fixture
def v3_server(short_dir: Path) -> Iterator[GpuServerProcess]:
    with running_gpu_server(short_dir, "--driver-mps-v3") as server:
        yield server


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with cgroup_tree() as tree:
        yield tree


class Client:
    def __init__(self, server: GpuServerProcess, pipe: Path, cgroup: Path, percent: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(server.root.socket), str(pipe), str(percent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        (cgroup / "cgroup.procs").write_text(str(self.proc.pid))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.reply = json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_the_probe_finds_v3_only_where_the_driver_has_it(
    short_dir: Path, v3_server: GpuServerProcess
) -> None:
    ok, detail = probe_v3(daemon_command(v3_server))
    assert ok, detail
    with running_gpu_server(short_dir / "old") as old:
        ok, detail = probe_v3(daemon_command(old))
        assert not ok and "exited 2" in detail
    cap = detect(daemon_command(v3_server), {0: "00000000:18:00.0"})
    assert cap.v3 and "unverified on hardware" in cap.describe()


def sharing_on(server: GpuServerProcess, root: Path, cgroups: dict[str, Path], v3: bool) -> MpsSharing:
    capability = MpsCapability(v3, "test", {0: False})
    sharing = MpsSharing(
        SharingSettings(mode=SharingMode.MPS, mps_root=root, ready_timeout_s=20.0, advisory_limits=not v3),
        gpus=gpus_of(server),
        command=daemon_command(server),
        mode=lambda: SharingMode.MPS,
        capability=capability,
    )
    sharing.cgroup_of = lambda pod_uid, _container: cgroups.get(pod_uid)
    return sharing


def run_cheat(server: GpuServerProcess, tree: CgroupTree, root: Path, *, v3: bool) -> dict[str, float]:
    """The benchmark's cheat: tenant (10 cores) at 100 % beside fixed 50 and fixed 40."""
    cores = {"tenant": 10, "fixed50": 50, "fixed40": 40}
    cgroups = {pod: tree.mkdir(UNIFIED, f"kubepods/pod-{pod}/ctr") for pod in cores}
    sharing = sharing_on(server, root, cgroups, v3)
    gpu = gpus_of(server)[0]
    clients = []
    try:
        shares = {}
        for pod, n in cores.items():
            grant = sharing.grant_for(
                ResolvedRequest(n, (gpu,)), Assignment(pod, "default", pod, "c", False, (0,), n, 1024)
            )
            assert grant is not None and grant.advisory is not v3
            env_percent = 100.0 if pod == "tenant" else float(grant.partition.percent)
            client = Client(server, grant.pipe_dir, cgroups[pod], env_percent)
            clients.append(client)
            assert client.reply["ok"], client.reply
            shares[pod] = client.reply["share"]
        assert sharing.advisory(0) is not v3  # vcuda_mps_limits_advisory
        reason = sharing.gpus()[0].reason
        if v3:
            assert "(enforceable)" in reason and "MPS v3 namespaces: yes" in reason, reason
            assert "unverified on hardware" in reason, reason
        else:
            assert "MPS v3 namespaces: no (test)" in reason, reason
        return shares
    finally:
        for client in clients:
            client.close()
        for daemon in sharing._daemons.values():
            daemon.stop()


def test_on_v3_the_tenant_that_sets_100_percent_stays_at_its_grant(
    short_dir: Path, v3_server: GpuServerProcess, tree: CgroupTree
) -> None:
    shares = run_cheat(v3_server, tree, short_dir / "mps", v3=True)
    assert shares == pytest.approx(
        {
            "tenant": effective_share(10, SMS),
            "fixed50": effective_share(50, SMS),
            "fixed40": effective_share(40, SMS),
        }
    )


def test_without_v3_the_same_tenant_lifts_itself_to_100_percent(
    short_dir: Path, v3_server: GpuServerProcess, tree: CgroupTree
) -> None:
    shares = run_cheat(v3_server, tree, short_dir / "mps", v3=False)
    assert shares["tenant"] == 1.0  # advisory: what the node's status and metrics say


def test_a_tenant_reaching_the_control_socket_cannot_rebind_itself(
    short_dir: Path, v3_server: GpuServerProcess, tree: CgroupTree
) -> None:
    cgroups = {"tenant": tree.mkdir(UNIFIED, "kubepods/pod-tenant/ctr")}
    sharing = sharing_on(v3_server, short_dir / "mps", cgroups, v3=True)
    try:
        grant = sharing.grant_for(
            ResolvedRequest(10, gpus_of(v3_server)[:1]),
            Assignment("tenant", "default", "t", "c", False, (0,), 10, 0),
        )
        assert grant is not None and grant.namespace == namespace_name("tenant", "c")
        for path in (short_dir, short_dir / "mps", *grant.pipe_dir.parents[:2], grant.pipe_dir):
            os.chmod(path, 0o755)
        os.chmod(grant.pipe_dir / "control", 0o777)  # every client must reach it
        lift = f"namespace set --name={grant.namespace} --active-thread-percentage=100"
        script = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1] + '/control')\n"
            "s.sendall(sys.argv[2].encode() + b'\\n\\n'); s.shutdown(socket.SHUT_WR)\n"
            "print(s.makefile().read().strip())\n"
        )
        done = subprocess.run(
            [SYSTEM_PYTHON, "-c", script, str(grant.pipe_dir), lift],
            user=TENANT_UID,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        assert done.stdout.strip().startswith("Error: permission denied"), (done.stdout, done.stderr)
        assert send_commands(grant.pipe_dir, [f"namespace get --name={grant.namespace}"]) == [
            f"10.0 0 {cgroups['tenant']}"
        ]
        client = Client(v3_server, grant.pipe_dir, cgroups["tenant"], 100.0)
        assert client.reply["share"] == pytest.approx(effective_share(10, SMS))
        client.close()
    finally:
        for daemon in sharing._daemons.values():
            daemon.stop()


def test_a_client_before_its_binding_gets_the_floor_and_the_next_tick_binds_it(
    short_dir: Path, v3_server: GpuServerProcess, tree: CgroupTree
) -> None:
    cgroup = tree.mkdir(UNIFIED, "kubepods/pod-late/ctr")
    known: dict[str, Path] = {}  # the agent has not seen the container's cgroup yet
    sharing = sharing_on(v3_server, short_dir / "mps", known, v3=True)
    try:
        grant = sharing.grant_for(
            ResolvedRequest(30, gpus_of(v3_server)[:1]),
            Assignment("late", "default", "l", "c", False, (0,), 30, 0),
        )
        assert grant is not None and grant.namespace is not None and not grant.advisory
        assert send_commands(grant.pipe_dir, ["namespace get --name=default"]) == ["1.0 0 -"]
        early = Client(v3_server, grant.pipe_dir, cgroup, 100.0)
        assert early.reply["share"] == pytest.approx(effective_share(1, SMS))  # never above a grant
        known["late"] = cgroup
        sharing.bind_pending()
        later = Client(v3_server, grant.pipe_dir, cgroup, 100.0)
        assert later.reply["share"] == pytest.approx(effective_share(grant.partition.percent, SMS))
        early.close()
        later.close()
        sharing.forget(set())  # the container left the ledger: its namespace goes
        assert send_commands(grant.pipe_dir, ["namespace list"]) == [""]
    finally:
        for daemon in sharing._daemons.values():
            daemon.stop()


AGENT = ("--device-guard", "off", "--no-ioctl-tracing", "--sharing-mode", "mps")
MEASURE_S = 6.0


def held(node: EnforcedNode, pod: str) -> dict[str, Any]:
    containers = fetch_status(node.state_dir / "status.sock")["gpus"][0]["containers"]
    return next((c for c in containers if c["pod"] == pod), {})


@pytest.mark.privileged
def test_a_root_tenant_that_lifts_its_namespace_is_held_at_its_grant_by_the_freezer(short_dir: Path) -> None:
    # The daemon runs as root (the agent's user) and refuses namespace administration only
    # to other uids: a tenant running as uid 0 changes its own namespace's limit. Its pod
    # spec claims non-root (so it got a grant), yet its process runs as uid 0 (the backstop
    # for a spec the runtime did not honour): the agent reads its uid, does not trust it to
    # its namespace, and the freezer holds it, blind (NVML credits its work to the MPS
    # server), to its grant's share of the GPU.
    real_layout()
    with enforced_node(short_dir, gpu_args=("--driver-mps-v3",), agent_args=AGENT) as node:
        box, pipe, namespace = start_tenant(node, "root", 10, user=None, lift=True)
        assert pipe is not None
        assert send_commands(pipe, [f"namespace get --name={namespace}"])[0].startswith("100.0 ")  # it worked
        row = wait_for(lambda: (r := held(node, "root")) and "uid 0" in r["computeDetail"] and r, 10, "held")
        assert row["computeHeldBy"] == "freezer", row
        why = "runs as uid 0, the MPS daemon's user: it could change its own namespace's limit"
        assert why in row["computeDetail"], row
        gpu = fetch_status(node.state_dir / "status.sock")["gpus"][0]
        assert "runs as uid 0" in gpu["sharingReason"] and "held by the freezer" in gpu["sharingReason"], gpu
        frozen_then_thawed(box.cgroup, 20, "the root tenant")  # held in turns, not frozen for good
        used = node.utilization([box], MEASURE_S)[0]
        # Alone, it would take 100 %; held, it gets far less (its share's accuracy is asserted in
        # virtual time: tests/unit/test_shares_virtual.py).
        assert 1.0 < used < 50, used
        metrics = node.metrics()
        held_by = [line for line in metrics.splitlines() if line.startswith("vcuda_container_held_by_info{")]
        assert any('pod="root"' in line and 'compute="freezer"' in line for line in held_by), held_by
        assert re.search(r'^vcuda_mps_limits_advisory\{gpu="0"[^}]*\} 0\.0$', metrics, re.M)
        assert "runs as uid 0, the MPS daemon's user" in node.agent_log()


@pytest.mark.privileged
def test_a_uid_1000_tenant_cannot_lift_its_namespace_and_stays_on_it(short_dir: Path) -> None:
    real_layout()
    with enforced_node(short_dir, gpu_args=("--driver-mps-v3",), agent_args=AGENT) as node:
        box, pipe, namespace = start_tenant(node, "tenant", 10, user=TENANT_UID, lift=True)
        assert pipe is not None
        row = wait_for(
            lambda: held(node, "tenant").get("computeHeldBy") == "mps+freezer" and held(node, "tenant"),
            10,
            "the tenant trusted to its namespace",
        )
        assert f"MPS v3 namespace {namespace}" in row["computeDetail"], row
        assert send_commands(pipe, [f"namespace get --name={namespace}"])[0].startswith("10.0 ")  # refused
        used = node.utilization([box], MEASURE_S)[0]
        # The namespace's limit is the server's: whatever the tenant sets, it runs at most at its
        # grant (9.1 % in virtual time, tests/unit/test_shares_virtual.py); a loaded host can only
        # make it less.
        assert 1.0 < used <= effective_share(10, SMS) * 100 + 2, used
        assert "uid 0" not in fetch_status(node.state_dir / "status.sock")["gpus"][0]["sharingReason"]


@pytest.mark.privileged
def test_a_pod_whose_spec_may_run_as_root_gets_no_mps_grant_and_is_held_at_its_share_time_sliced(
    short_dir: Path,
) -> None:
    # No securityContext (most pods): it may run as the daemon's uid, so at Allocate it gets
    # no MPS grant at all (no CUDA_MPS_* variables, no pipe mount: it cannot reach the control
    # socket), runs as a plain time-sliced context, and the freezer holds it by its own NVML
    # samples. It still tries to lift itself (its env says 100 %): without MPS that is nothing.
    # A non-root pod that comes to the same GPU is time-sliced too (a daemon would not attach
    # beside that context) and keeps its fixed share.
    real_layout()
    with enforced_node(short_dir, gpu_args=("--driver-mps-v3",), agent_args=AGENT) as node:
        box, pipe, _ = start_tenant(node, "root", 30, user=None, lift=True, queue=16, security=None)
        response = node.responses["root"]
        assert pipe is None and not [k for k in response.envs if k.startswith("CUDA_MPS_")], response
        assert not [m for m in response.mounts if "mps" in m.container_path], response
        user, user_pipe, _ = start_tenant(node, "user", 60, user=TENANT_UID, queue=16)
        assert user_pipe is None

        def both() -> list[dict[str, Any]] | None:
            rows = [held(node, "root"), held(node, "user")]
            return rows if all(r.get("computeHeldBy") == "freezer" for r in rows) else None

        rows = wait_for(both, 10, "both held by the freezer")
        assert "may run as root" in rows[0]["computeDetail"], rows
        assert "time-sliced and held by the freezer" in rows[0]["computeDetail"], rows
        assert "holds " in rows[1]["computeDetail"] and "time-sliced" in rows[1]["computeDetail"], rows
        for container, name in ((box, "root"), (user, "user")):  # held in turns, time-sliced
            frozen_then_thawed(container.cgroup, 20, name)
        used = node.utilization([box, user], MEASURE_S)
        # Each held below the whole GPU (30 and 60 within 3 pp in virtual time:
        # tests/unit/test_enforcer.py, the two fixed-share neighbours); together at most all of it.
        assert all(u < 90 for u in used) and sum(used) <= 103, used
        gpu = fetch_status(node.state_dir / "status.sock")["gpus"][0]
        assert gpu["mpsDaemon"] is None or gpu["mpsDaemon"]["state"] != "running", gpu  # no MPS client
        assert "gets no MPS grant" in node.agent_log()


def test_the_agent_trusts_a_namespace_by_its_shares_uids_and_opens_an_untrusted_one_to_the_freezer(
    short_dir: Path, v3_server: GpuServerProcess, tree: CgroupTree
) -> None:
    cgroups = {pod: tree.mkdir(UNIFIED, f"kubepods/pod-{pod}/ctr") for pod in ("root", "user")}
    sharing = sharing_on(v3_server, short_dir / "mps", cgroups, v3=True)
    uids = {"root": frozenset({os.geteuid()}), "user": frozenset({TENANT_UID})}
    sharing.uids_of = lambda pod_uid, _container: uids[pod_uid]
    try:
        grants = {
            pod: sharing.grant_for(
                ResolvedRequest(10, gpus_of(v3_server)[1:2] if pod == "user" else gpus_of(v3_server)[:1]),
                Assignment(pod, "default", pod, "c", False, (1 if pod == "user" else 0,), 10, 0),
            )
            for pod in ("root", "user")
        }
        assert all(g is not None and g.namespace for g in grants.values())
        assert sharing.untrusted("root", "c") is not None  # no reading yet
        sharing.check_users()
        assert "runs as uid 0, the MPS daemon's user" in (sharing.untrusted("root", "c") or "")
        assert sharing.blind_share("root", "c") == pytest.approx(effective_share(10, SMS) * 100, abs=0.01)
        assert sharing.untrusted("user", "c") is None and sharing.blind_share("user", "c") is None
        root, user = grants["root"], grants["user"]
        assert root is not None and user is not None
        # the freezer alone holds the root share now: its namespace is opened to 100 %
        assert send_commands(root.pipe_dir, [f"namespace get --name={root.namespace}"])[0].startswith(
            "100.0 "
        )
        assert send_commands(user.pipe_dir, [f"namespace get --name={user.namespace}"])[0].startswith("10.0 ")
        assert "root/c: runs as uid 0" in sharing.gpus()[0].reason
    finally:
        for daemon in sharing._daemons.values():
            daemon.stop()
