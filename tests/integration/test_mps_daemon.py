"""MPS control daemons run and watched by the agent, with a stand-in daemon binary (a real
process; tests/fakes/mps-control-standin): started at a GPU's first share, restarted when
killed, adopted across agent restarts, stopped when the GPU holds no share; a missing binary
is a clear reason and the freezer holds the shares."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.control.mpssharing import MpsSharing
from agent.domain.annotations import Policy
from agent.domain.ledger import Assignment
from agent.domain.requests import ResolvedRequest
from agent.domain.specs import SpecBounds, build_spec
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.mpsdaemon import DaemonState
from agent.platform.procfs import ProcFS
from agent.settings import SharingMode, SharingSettings

STANDIN = Path(__file__).resolve().parents[1] / "fakes" / "mps-control-standin"
GPUS = tuple(
    GpuInfo(i, f"GPU-{i}{i}{i}{i}0000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", 81559, i, "", 0)
    for i in range(2)
)


class Node:
    def __init__(
        self, root: Path, command: list[str], mode: SharingMode = SharingMode.MPS, *, advisory: bool = True
    ) -> None:
        self.shares = {0: 1, 1: 0}
        self.settings = SharingSettings(
            mode=mode, mps_root=root, ready_timeout_s=5.0, idle_stop_s=0.0, advisory_limits=advisory
        )
        self.command = command
        self.sharings: list[MpsSharing] = []

    def agent(self) -> MpsSharing:
        sharing = MpsSharing(
            self.settings,
            gpus=GPUS,
            command=self.command,
            mode=lambda: self.settings.mode,
            shares_on=self.shares.__getitem__,
        )
        self.sharings.append(sharing)
        return sharing


@pytest.fixture
def node(short_dir: Path) -> Iterator[Node]:
    node = Node(short_dir / "mps", [str(STANDIN), "-f"])
    yield node
    for sharing in node.sharings:
        for daemon in sharing._daemons.values():
            daemon.stop()


def share(gpu: int = 0, cores: int = 30) -> ResolvedRequest:
    return ResolvedRequest(cores, (GPUS[gpu],))


def daemon_pid(sharing: MpsSharing, gpu: int = 0) -> int:
    status = sharing.daemon_statuses()[gpu]
    assert status.pid is not None, status
    return status.pid


def wait_state(sharing: MpsSharing, state: DaemonState, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sharing.daemon_statuses()[0].state is not state:
        assert time.monotonic() < deadline, f"daemon still {sharing.daemon_statuses()[0]}"
        sharing.tick()
        time.sleep(0.05)


def test_the_first_share_starts_its_gpus_daemon(node: Node) -> None:
    sharing = node.agent()
    assert [s.state for s in sharing.daemon_statuses()] == [DaemonState.STOPPED] * 2
    grant = sharing.grant_for(share(cores=30), None)
    assert grant is not None and grant.partition.percent == 29 and grant.partition.sms == 38
    status = sharing.daemon_statuses()[0]
    assert status.state is DaemonState.RUNNING and ProcFS().stat(daemon_pid(sharing)).comm == "python3"
    assert (grant.pipe_dir / "control").exists()
    log = (grant.log_dir / "control.log").read_text()
    assert f"serving {GPUS[0].uuid}" in log  # CUDA_VISIBLE_DEVICES named its GPU
    assert sharing.daemon_statuses()[1].state is DaemonState.STOPPED  # no share there: no daemon
    assert sharing.grant_for(ResolvedRequest(100, (GPUS[1],)), None) is None  # whole GPUs: never


def test_a_killed_daemon_is_restarted(node: Node) -> None:
    sharing = node.agent()
    assert sharing.grant_for(share(), None) is not None
    first = daemon_pid(sharing)
    os.kill(first, signal.SIGKILL)
    wait_state(sharing, DaemonState.RESTARTING)
    status = sharing.daemon_statuses()[0]
    assert status.restarts == 1 and "exited" in status.error
    wait_state(sharing, DaemonState.RUNNING)  # after its 1 s back-off
    assert daemon_pid(sharing) != first
    assert sharing.daemon_statuses()[0].restarts == 1


def test_a_restarted_agent_adopts_the_running_daemon(node: Node) -> None:
    first = node.agent()
    assert first.grant_for(share(), None) is not None
    pid = daemon_pid(first)
    second = node.agent()  # the agent restarted: its clients must not lose their server
    second.resume()
    wait_state(second, DaemonState.RUNNING)  # watched from the start, before any Allocate
    assert daemon_pid(second) == pid
    assert second.grant_for(share(), None) is not None
    assert daemon_pid(second) == pid
    os.kill(pid, signal.SIGKILL)  # not its child, still restarted when it dies
    wait_state(second, DaemonState.RESTARTING)
    wait_state(second, DaemonState.RUNNING)
    assert daemon_pid(second) != pid


def test_a_gpu_without_shares_loses_its_daemon(node: Node) -> None:
    sharing = node.agent()
    assert sharing.grant_for(share(), None) is not None
    pid = daemon_pid(sharing)
    node.shares[0] = 0
    sharing.tick()  # idle_stop_s is 0 here: the first tick that sees no share stops it
    sharing.tick()
    assert sharing.daemon_statuses()[0].state is DaemonState.STOPPED
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and ProcFS().stat(pid).state != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_missing_daemon_binary_is_a_clear_reason_and_the_freezer_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path / "mps", ["/nonexistent/nvidia-cuda-mps-control", "-f"])
    sharing = node.agent()
    assert sharing.unavailable is not None and "/nonexistent/nvidia-cuda-mps-control" in sharing.unavailable
    with caplog.at_level(logging.ERROR):
        assert sharing.grant_for(share(), None) is None
        assert sharing.grant_for(share(), None) is None
    assert caplog.text.count("held by the freezer") == 1  # said once, not per Allocate
    (gpu0, _gpu1) = sharing.gpus()
    assert gpu0.actuator == "freezer" and "not found" in gpu0.reason
    assert not (tmp_path / "mps").exists() or not any((tmp_path / "mps").iterdir())


def test_freezer_mode_starts_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path / "mps", [str(STANDIN), "-f"], mode=SharingMode.FREEZER)
    sharing = node.agent()
    assert sharing.grant_for(share(), None) is None
    assert [g.actuator for g in sharing.gpus()] == ["freezer", "freezer"]
    assert all(s.state is DaemonState.STOPPED for s in sharing.daemon_statuses())


def test_a_daemon_that_never_comes_up_is_given_up_on(tmp_path: Path) -> None:
    node = Node(tmp_path / "mps", ["/bin/sh", "-c", "echo no GPU driver here >&2; exit 3"])
    sharing = node.agent()
    assert sharing.unavailable is None  # the command exists; it just cannot serve
    assert sharing.grant_for(share(), None) is None  # not up within the Allocate wait
    deadline = time.monotonic() + 15
    while sharing.daemon_statuses()[0].state is not DaemonState.FAILED:
        assert time.monotonic() < deadline, sharing.daemon_statuses()[0]
        sharing.tick()
        time.sleep(0.1)
    reason = sharing.why_not(0)
    assert reason is not None and "3 times" in reason and "no GPU driver here" in reason
    assert sharing.grant_for(share(), None) is None  # at once now: the freezer holds it


def test_by_default_no_mps_limit_a_tenant_can_lift_is_used(tmp_path: Path) -> None:
    node = Node(tmp_path / "mps", [str(STANDIN), "-f"], advisory=False)
    sharing = node.agent()
    assert sharing.grant_for(share(), None) is None  # held by the freezer
    reason = sharing.why_not(0)
    assert reason is not None and "advisory" in reason and "mpsAdvisoryLimits" in reason
    assert [g.actuator for g in sharing.gpus()] == ["freezer", "freezer"]
    assert sharing.daemon_statuses()[0].state is DaemonState.STOPPED  # no daemon started
    assert not sharing.advisory(0)


def test_limits_that_bind_are_used_without_being_asked(short_dir: Path) -> None:
    node = Node(short_dir / "mps", [str(STANDIN), "-f"], advisory=False)
    sharing = MpsSharing(
        node.settings, gpus=GPUS, command=node.command, mode=lambda: SharingMode.MPS, advisory_reason=None
    )
    node.sharings.append(sharing)
    grant = sharing.grant_for(share(), None)
    assert grant is not None and not grant.advisory and "advisory" not in grant.describe()


def test_an_advisory_grant_says_so(node: Node) -> None:
    sharing = node.agent()
    grant = sharing.grant_for(share(), None)
    assert grant is not None and grant.advisory and "advisory" in grant.describe()
    assert sharing.advisory(0)


def test_a_link_planted_in_the_pipe_directory_is_removed_before_the_daemon_starts(
    node: Node, tmp_path: Path
) -> None:
    victim = tmp_path / "root-owned"
    victim.write_text("untouched\n")
    pipe = node.settings.mps_root / GPUS[0].uuid / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "nvidia-cuda-mps-control.pid").symlink_to(victim)  # where the daemon writes its pid
    (pipe / "elsewhere").symlink_to("/etc")
    sharing = node.agent()
    assert sharing.grant_for(share(), None) is not None
    assert not (pipe / "nvidia-cuda-mps-control.pid").is_symlink() and not (pipe / "elsewhere").exists()
    assert victim.read_text() == "untouched\n"


def test_a_replaced_control_socket_restarts_the_daemon(node: Node) -> None:
    sharing = node.agent()
    grant = sharing.grant_for(share(), None)
    assert grant is not None
    first = daemon_pid(sharing)
    control = grant.pipe_dir / "control"
    control.unlink()
    impostor = socket.socket(socket.AF_UNIX)
    impostor.bind(str(control))  # a tenant's own "daemon"
    try:
        sharing.tick()
        status = sharing.daemon_statuses()[0]
        assert status.restarts == 1 and "replaced" in status.error
        wait_state(sharing, DaemonState.RUNNING)
        assert daemon_pid(sharing) != first
        assert Path(f"/proc/{first}").exists() is False or ProcFS().stat(first).state == "Z"
    finally:
        impostor.close()


@pytest.mark.parametrize("policy", ["best-effort", "burst-share"])
def test_best_effort_and_burst_ceilings_never_take_what_fixed_shares_hold(node: Node, policy: str) -> None:
    tenant = Assignment("uid-t", "default", "tenant", "c", False, (0,), 10, 1024, policy=policy, source="dra")
    spec = build_spec(tenant, None, Policy.FIXED_SHARE, SpecBounds(allowed=frozenset(Policy)))
    assert spec.policy.value == policy
    sharing = MpsSharing(
        node.settings,
        gpus=GPUS,
        command=node.command,
        mode=lambda: SharingMode.MPS,
        spec_for=lambda _a: spec,
        fixed_on=lambda gpu, a: 90 if gpu == 0 and a is tenant else 0,  # fixed 50 + fixed 40 beside it
    )
    node.sharings.append(sharing)
    grant = sharing.grant_for(ResolvedRequest(10, (GPUS[0],)), tenant)
    assert grant is not None
    assert grant.partition.effective_percent <= 10  # 100 - 90, whole TPCs within it


def test_clients_of_different_user_ids_on_one_gpu_are_reported(node: Node) -> None:
    sharing = node.agent()
    users = {"uid-a": frozenset({0}), "uid-b": frozenset({1000})}
    heard: list[tuple[int, list[str], list[int]]] = []
    sharing.users_of = lambda pod_uid, _container: users.get(pod_uid, frozenset())
    sharing.on_mixed_users = lambda gpu, keys, uids: heard.append((gpu, keys, uids))
    for pod in ("a", "b"):
        item = Assignment(f"uid-{pod}", "default", pod, "c", False, (0,), 30, 1024)
        assert sharing.grant_for(share(), item) is not None
    sharing.tick()
    assert heard == [(0, ["uid-a/c", "uid-b/c"], [0, 1000])]
    gpu0 = sharing.gpus()[0]
    assert gpu0.actuator == "mps" and "user ids 0, 1000" in gpu0.reason
    sharing.tick()
    assert len(heard) == 1  # said once, not every tick
    users["uid-b"] = frozenset({0})  # the same user now: nothing to say
    sharing.tick()
    assert sharing.mixed_users == {} and "user ids" not in sharing.gpus()[0].reason
