"""The device guard for containers holding MIG devices: kubelet's pod-resources says which
container holds which MIG device (agent/control/migholdings.py), the guard's targets and the
pod gate allow its parent GPU and exactly its capability nodes, the agent's own MIG resources
exempt no pod, and both enforcers (v1 lines, the v2 program's policy) take exactly the rest."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agent.clock import Clock
from agent.control.guardtargets import GuardTargets
from agent.control.migholdings import MigGrant, MigHoldings
from agent.control.migoffers import MigOffers
from agent.domain.ledger import Ledger
from agent.domain.migoffer import MigOffer, OfferedDevice
from agent.errors import KubeletError
from agent.platform.cgroups.devicepolicy import DevicePolicy, NvidiaMajors
from agent.platform.cgroups.devices_v1 import ALLOW_ALL, parse_devices_list, plan
from agent.platform.cgroups.devices_v2 import MAX_CAPS, POLICY_VALUE, policy_value
from agent.platform.gpu.migprofiles import ci_cap_minor, gi_cap_minor
from agent.platform.gpu.migstate import MigDevice
from tests.unit.kubefixtures import make_gpus
from tests.unit.test_guard_exemptions import cache, gpu_plugin_pod

CAPS, IMEX, UVM = 236, 235, 510
MAJORS = NvidiaMajors(uvm=frozenset({UVM}), caps=frozenset({IMEX, CAPS}), mig_caps=frozenset({CAPS}))
GI, CI = gi_cap_minor(1, 5), ci_cap_minor(1, 5, 0)  # GPU 1, GPU instance 5, compute instance 0
MIG = DevicePolicy(frozenset({1}), frozenset({GI, CI}))


def test_a_mig_holder_may_open_its_gpu_and_exactly_its_capabilities() -> None:
    assert MIG.allows(195, 1, MAJORS) and MIG.allows(195, 255, MAJORS) and MIG.allows(UVM, 0, MAJORS)
    assert MIG.allows(CAPS, GI, MAJORS) and MIG.allows(CAPS, CI, MAJORS)
    assert not MIG.allows(CAPS, CI + 1, MAJORS)  # the next compute instance
    assert not MIG.allows(CAPS, 1, MAJORS) and not MIG.allows(CAPS, 2, MAJORS)  # config, monitor
    assert not MIG.allows(IMEX, GI, MAJORS) and not MIG.allows(195, 0, MAJORS)
    assert MIG.describe() == f"/dev/nvidia1 + nvidiactl + uvm + nvidia-cap{GI} + nvidia-cap{CI} only"
    with pytest.raises(ValueError, match="a MIG device needs its parent GPU"):
        DevicePolicy(None, frozenset({GI}))


DEVICES = [(195, m) for m in (0, 1, 255)] + [(CAPS, m) for m in (1, 2, GI - 1, GI, CI, CI + 1, 3)]
DEVICES += [(IMEX, 0), (UVM, 0), (1, 3)]
WHITELISTS = {
    "allow-all (privileged)": ["a *:* rwm"],
    "caps wildcard": ["c 1:3 rwm", "c 195:* rw", f"c {UVM}:* rw", f"c {CAPS}:* r", f"c {IMEX}:* r"],
    "caps listed": ["c 195:1 rw", "c 195:255 rw", f"c {CAPS}:{GI} r", f"c {CAPS}:{CI} r", f"c {CAPS}:2 r"],
}


@dataclass
class Kernel:
    """security/device_cgroup.c's semantics, as tests/unit/test_cgroup_devices.py models them."""

    default_allow: bool
    exceptions: set[tuple[int | None, int | None, str]]

    def permits(self, major: int, minor: int, access: str) -> bool:
        matched = any(
            ma in (None, major) and mi in (None, minor) and access in acc for ma, mi, acc in self.exceptions
        )
        return not matched if self.default_allow else matched


@pytest.mark.parametrize("whitelist", WHITELISTS)
def test_the_v1_plan_takes_all_but_the_mig_devices_nodes(whitelist: str) -> None:
    rules = parse_devices_list("\n".join(WHITELISTS[whitelist]))
    kernel = Kernel(
        ALLOW_ALL in rules, set() if ALLOW_ALL in rules else {(r.major, r.minor, r.access) for r in rules}
    )
    before = {(d, a): kernel.permits(*d, a) for d in DEVICES for a in "rw"}
    result = plan(rules, MIG, MAJORS)
    assert not result.problems
    for rule in result.allow:
        kernel.exceptions.add((rule.major, rule.minor, rule.access))
    for rule in result.deny:
        if kernel.default_allow:
            kernel.exceptions.add((rule.major, rule.minor, rule.access))
        else:
            kernel.exceptions = {e for e in kernel.exceptions if e[:2] != (rule.major, rule.minor)}
    for (device, access), was in before.items():
        assert kernel.permits(*device, access) == (was and MIG.allows(*device, MAJORS)), (device, access)


def test_the_v1_plan_of_a_privileged_mig_container_denies_the_other_caps_of_its_gpus() -> None:
    lines = {r.line() for r in plan([ALLOW_ALL], MIG, MAJORS).deny}
    assert f"c {CAPS}:{GI - 1} rwm" in lines and f"c {CAPS}:{GI} rwm" not in lines
    assert f"c {CAPS}:{gi_cap_minor(2, 0) - 1} rwm" in lines  # up to GPU 1's last capability
    assert f"c {IMEX}:* rwm" in lines and f"c {CAPS}:* rwm" not in lines


def test_the_v2_policy_carries_the_capability_minors() -> None:
    words = POLICY_VALUE.unpack(policy_value(MIG, audit=False))
    assert words[4:6] == (1, 2)  # POLICY_HAS_GPU; two capability minors
    assert words[6:8] == (GI, CI) and words[8 : 6 + MAX_CAPS] == (0,) * (MAX_CAPS - 2)
    assert words[-1] == 0 and POLICY_VALUE.size == 112
    too_many = DevicePolicy(frozenset({0}), frozenset(range(3, 3 + MAX_CAPS + 1)))
    with pytest.raises(Exception, match="holds 16"):
        policy_value(too_many, audit=True)


def device(gpu: int, gi: int, uuid: str) -> MigDevice:
    return MigDevice(
        gpu, 0, gi, 0, uuid, "3g.40gb", "3g.40gb", 9, 2, 0, 4, 40448, 60,
        gi_cap_minor(gpu, gi), ci_cap_minor(gpu, gi, 0),
    )  # fmt: skip


@dataclass(frozen=True)
class Record:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class Truth:
    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.calls = 0
        self.fail = False

    def list(self) -> list[Record]:
        self.calls += 1
        if self.fail:
            raise KubeletError("pod-resources is down")
        return self.records

    def get(self, namespace: str, name: str) -> Any:
        raise AssertionError("List only")


def test_holdings_join_kubelets_word_to_the_pods_and_the_offer() -> None:
    gpus = make_gpus()
    tenant = gpu_plugin_pod("tenant", "nvidia.com/mig-3g.40gb", "1")  # team-a/tenant, container main
    offered = OfferedDevice(device(1, 5, "MIG-aaaa"), gpus[1])
    offer = MigOffer({"nvidia.com/mig-3g.40gb": (offered,)})
    offers = cast(MigOffers, SimpleNamespace(current=lambda: (1, offer)))
    records = [Record("team-a", "tenant", "main", "nvidia.com/mig-3g.40gb", ("MIG-aaaa", "MIG-gone"))]
    records.append(Record("team-a", "tenant", "main", "nvidia.com/vcuda-core", ("x",)))  # not MIG
    truth = Truth(records)
    pods = SimpleNamespace(find=lambda ns, name: tenant if (ns, name) == ("team-a", "tenant") else None)
    now = [0.0]
    clock = SimpleNamespace(monotonic=lambda: now[0])
    resources = frozenset({"nvidia.com/mig-3g.40gb"})
    holdings = MigHoldings(truth, pods, offers, lambda: resources, ttl_s=1.0, clock=cast(Clock, clock))
    assert holdings.grants() == {(tenant.uid, "main"): MigGrant(frozenset({1}), frozenset({GI, CI}))}
    holdings.grants()
    assert truth.calls == 1  # within the TTL
    holdings.invalidate()  # an Allocate: ask again
    truth.fail = True
    assert holdings.grants() == {(tenant.uid, "main"): MigGrant(frozenset({1}), frozenset({GI, CI}))}
    assert truth.calls == 2  # kubelet down: the last answer stands

    # The guard: the container gets GPU 1 and its capabilities; the pod gate the same.
    targets = GuardTargets(
        cache(tenant), Ledger(gpus), gpus, node_resources=lambda: {"nvidia.com/mig-3g.40gb": "1"}
    )
    targets.add_mig(holdings.grants, lambda: frozenset({"nvidia.com/mig-3g.40gb"}))
    by_name = {t.label.split("/")[1]: t for t in targets()}
    assert (by_name["tenant"].gpu_minors, by_name["tenant"].cap_minors) == (
        frozenset({1}),
        frozenset({GI, CI}),
    )
    assert targets.exemptions() == []  # the agent's own MIG resource exempts nobody
    assert targets.pod_policy(tenant.uid) == MIG


def test_offered_by_another_plugin_a_mig_resource_still_exempts() -> None:
    gpus = make_gpus()
    other = gpu_plugin_pod("other", "nvidia.com/mig-1g.10gb", "1")
    targets = GuardTargets(
        cache(other), Ledger(gpus), gpus, node_resources=lambda: {"nvidia.com/mig-1g.10gb": "2"}
    )
    targets.add_mig(dict, lambda: frozenset({"nvidia.com/mig-3g.40gb"}))
    assert list(targets()) == [] and [e.pod for e in targets.exemptions()] == ["other"]
