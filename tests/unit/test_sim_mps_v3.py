"""The simulated MPS v3 control daemon (protocol 3, r615+/R620): a namespace bound to a
cgroup gives that cgroup's clients its limits on the daemon's side, so a client's own
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE cannot raise them (the tenant trick that makes protocol-2
limits advisory); only the daemon's owner changes namespaces (an assumption, marked so in
agent/platform/gpu/sim/mpsnamespaces.py); protocol 2 is unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from agent.platform.gpu.sim.memory import OutOfMemory, check_allocation
from agent.platform.gpu.sim.mpscontrol import MpsControl

DAEMON = 4242
GIB = 1 << 30
POD = "/sys/fs/cgroup/kubepods/pod-a/ctr"
OTHER = "/sys/fs/cgroup/kubepods/pod-b/ctr"


@dataclass
class Holder:
    memory_bytes: int
    memory_limit: int | None
    cgroup: str


def bound(percent: int, cgroup: str = POD, name: str = "share-a", memory: str | None = None) -> MpsControl:
    control = MpsControl(DAEMON, protocol=3)
    assert control.command(f"namespace create --name={name}") == ""
    assert control.command(f"namespace set --name={name} --active-thread-percentage={percent}") == ""
    if memory is not None:
        assert control.command(f"namespace set --name={name} --pinned-memory-limit={memory}") == ""
    assert control.command(f"namespace bind --name={name} --cgroup={cgroup}") == ""
    return control


def test_a_client_in_a_bound_cgroup_stays_at_its_namespaces_limit_whatever_its_env_says() -> None:
    control = bound(8)
    cheat = control.admit(100, uid=1000, env_percentage=100.0, env_pinned=None, cgroup=POD)
    assert cheat is not None and cheat.percentage == 8.0  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100
    unset = control.admit(101, uid=1000, env_percentage=None, env_pinned=None, cgroup=POD + "/sub")
    assert unset is not None and unset.percentage == 8.0  # a cgroup below the bound one
    lower = control.admit(102, uid=1000, env_percentage=5.0, env_pinned=None, cgroup=POD)
    assert lower is not None and lower.percentage == 5.0  # its own variable still lowers it
    elsewhere = control.admit(103, uid=1000, env_percentage=None, env_pinned=None, cgroup=OTHER)
    assert elsewhere is not None and elsewhere.percentage == 100.0  # the default namespace


def test_on_protocol_2_the_same_client_lifts_itself_to_the_daemons_100() -> None:
    control = MpsControl(DAEMON)
    assert control.command("namespace create --name=share-a").startswith("Error")
    cheat = control.admit(100, uid=1000, env_percentage=100.0, env_pinned=None, cgroup=POD)
    assert cheat is not None and cheat.percentage == 100.0


def test_the_namespaces_memory_limit_refuses_allocations_over_it() -> None:
    control = bound(50, memory="2G")
    limits = control.admit(100, uid=1000, env_percentage=None, env_pinned=8 * GIB, cgroup=POD)
    assert limits is not None and limits.pinned_bytes == 2 * GIB  # its env cannot raise it
    ctx = Holder(0, limits.pinned_bytes, POD)
    check_allocation(ctx, GIB, gpu=0, capacity=80 * GIB, contexts=[ctx], cgroup_limits={})
    ctx.memory_bytes = GIB
    try:
        check_allocation(ctx, 2 * GIB, gpu=0, capacity=80 * GIB, contexts=[ctx], cgroup_limits={})
    except OutOfMemory as err:
        assert "2048 MiB" in str(err)
    else:
        raise AssertionError("an allocation over the namespace's limit went through")


def test_the_deepest_binding_wins_and_rebinding_moves_a_cgroup() -> None:
    control = bound(50, cgroup="/sys/fs/cgroup/kubepods", name="wide")
    control.command("namespace create --name=narrow")
    control.command("namespace set --name=narrow --active-thread-percentage=20")
    control.command(f"namespace bind --name=narrow --cgroup={POD}")
    inner = control.admit(100, uid=0, env_percentage=None, env_pinned=None, cgroup=POD)
    outer = control.admit(101, uid=0, env_percentage=None, env_pinned=None, cgroup=OTHER)
    assert inner is not None and outer is not None and (inner.percentage, outer.percentage) == (20.0, 50.0)
    assert control.command("namespace get --name=narrow") == f"20.0 0 {POD}"
    control.command(f"namespace bind --name=wide --cgroup={POD}")
    assert control.command("namespace get --name=narrow") == "20.0 0 -"
    assert control.command("namespace list") == "narrow\nwide"
    assert control.command("namespace delete --name=narrow") == ""
    assert control.command("namespace list") == "wide"


def test_only_the_daemons_owner_changes_namespaces_or_limits() -> None:
    control = bound(10)
    for line in (
        "namespace set --name=share-a --active-thread-percentage=100",
        f"namespace bind --name=share-a --cgroup={OTHER}",
        "namespace delete --name=share-a",
        "set_default_active_thread_percentage 100",
        "quit",
    ):
        assert control.command(line, owner=False).startswith("Error: permission denied"), line
    assert not control.quit_requested
    assert control.command("namespace get --name=share-a", owner=False) == f"10.0 0 {POD}"
    assert control.command("get_default_active_thread_percentage", owner=False) == "100.0"
    tenant = control.admit(100, uid=1000, env_percentage=100.0, env_pinned=None, cgroup=POD)
    assert tenant is not None and tenant.percentage == 10.0


def test_bad_namespace_commands_are_refused_with_a_reason() -> None:
    control = MpsControl(DAEMON, protocol=3)
    assert control.command("namespace").startswith("Error: usage")
    assert control.command("namespace create name=x").startswith("Error")
    assert control.command("namespace create --name=a/b").startswith("Error")
    assert (
        control.command("namespace set --name=nope --active-thread-percentage=5")
        == "Error: no namespace nope"
    )
    control.command("namespace create --name=a")
    assert control.command("namespace create --name=a") == "Error: namespace a exists"
    assert control.command("namespace set --name=a --active-thread-percentage=0").startswith(
        "Error: percentage"
    )
    assert control.command("namespace bind --name=a --cgroup=relative").startswith("Error")
    assert control.command("namespace bind --name=a --cgroup=/x/../y").startswith("Error")
    assert control.command("namespace frobnicate --name=a").startswith("Error: unknown namespace verb")


def test_the_default_namespace_holds_clients_no_binding_covers() -> None:
    control = bound(30)
    assert control.command("namespace set --name=default --active-thread-percentage=2") == ""
    early = control.admit(100, uid=1000, env_percentage=100.0, env_pinned=None, cgroup=OTHER)
    assert early is not None and early.percentage == 2.0  # before the agent bound its cgroup
    assert control.command("namespace delete --name=default").startswith("Error")
    assert control.command(f"namespace bind --name=default --cgroup={OTHER}").startswith("Error")
    assert control.command("namespace create --name=default") == "Error: namespace default exists"
