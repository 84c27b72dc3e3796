"""Device-guard exemptions are the admin's: the annotation counts only in the namespaces
the agent was told (--guard-exempt-namespaces); elsewhere it is refused with one Event."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from agent.control.deviceguard import TargetsNotReadyError
from agent.control.guardtargets import EXEMPT_ANNOTATION, EXEMPTION_REFUSED, GuardTargets
from agent.domain.ledger import Assignment, Ledger
from agent.platform.cgroups.devicepolicy import DevicePolicy
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import container, make_gpus, make_pod


@dataclass
class Events:
    pods: list[tuple[str, str, str]] = field(default_factory=list)

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        self.pods.append((pod.name, reason, message))

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        raise AssertionError("pod Events only")


def cache(*pods: PodInfo) -> Any:
    by_uid = {p.uid: p for p in pods}
    return SimpleNamespace(
        pods=lambda: list(pods), get=by_uid.get, stats=lambda: SimpleNamespace(synced=True)
    )


def started(name: str, namespace: str, exempt: bool) -> PodInfo:
    annotations = {EXEMPT_ANNOTATION: "exempt"} if exempt else {}
    pod = make_pod(name, container("main"), namespace=namespace, annotations=annotations)
    return PodInfo(
        **{
            **pod.__dict__,
            "containers": tuple(
                type(c)(**{**c.__dict__, "container_id": f"containerd://{name}"}) for c in pod.containers
            ),
        }
    )


def test_the_annotation_counts_only_in_the_admins_namespaces() -> None:
    gpus = make_gpus()
    dcgm = started("dcgm", "monitoring", exempt=True)
    tenant = started("sneaky", "team-a", exempt=True)
    plain = started("plain", "team-a", exempt=False)
    events = Events()
    targets = GuardTargets(
        cache(dcgm, tenant, plain),
        Ledger(gpus),
        gpus,
        exempt_namespaces=frozenset({"monitoring"}),
        events=events,
    )
    guarded = {t.label.split("/")[1] for t in targets()}
    assert guarded == {"sneaky", "plain"}  # the tenant's own annotation did not exempt it
    targets()  # every reconcile asks again: one Event per pod, not one per pass
    assert [(n, r) for n, r, _ in events.pods] == [("sneaky", EXEMPTION_REFUSED)]
    assert "--guard-exempt-namespaces" in events.pods[0][2]


def test_by_default_no_annotation_exempts_anyone_but_the_agents_own_pod_is_left_alone() -> None:
    gpus = make_gpus()
    agent = started("vcuda-agent-x", "kube-system", exempt=False)
    dcgm = started("dcgm", "monitoring", exempt=True)
    targets = GuardTargets(cache(agent, dcgm), Ledger(gpus), gpus, agent.uid)
    assert {t.label.split("/")[1] for t in targets()} == {"dcgm"}


def gpu_plugin_pod(name: str, resource: str, quantity: str) -> PodInfo:
    spec = container("main")
    spec["resources"]["limits"][resource] = quantity
    pod = make_pod(name, spec, namespace="team-a")
    return PodInfo(
        **{
            **pod.__dict__,
            "containers": tuple(
                type(c)(**{**c.__dict__, "container_id": f"containerd://{name}"}) for c in pod.containers
            ),
        }
    )


NODE_RESOURCES = {
    "cpu": "8",
    "nvidia.com/gpu": "4",
    "nvidia.com/mig-1g.10gb": "0",
    "nvidia.com/vcuda-core": "400",
}


def test_a_zero_quantity_of_another_plugins_gpu_does_not_exempt_a_pod() -> None:
    # "nvidia.com/gpu: 0" fits every node, so any tenant can write it; with the NVIDIA runtime
    # and NVIDIA_VISIBLE_DEVICES=all it would open every GPU, were it exempt.
    gpus = make_gpus()
    zero = gpu_plugin_pod("zero", "nvidia.com/gpu", "0")
    zero_mig = gpu_plugin_pod("zero-mig", "nvidia.com/mig-3g.40gb", "0")
    unoffered = gpu_plugin_pod("unoffered", "nvidia.com/mig-1g.10gb", "1")  # the node offers 0 of it
    junk = gpu_plugin_pod("junk", "nvidia.com/gpu", "lots")
    real = gpu_plugin_pod("real", "nvidia.com/gpu", "1")
    events = Events()
    targets = GuardTargets(
        cache(zero, zero_mig, unoffered, junk, real),
        Ledger(gpus),
        gpus,
        events=events,
        node_resources=lambda: NODE_RESOURCES,
    )
    guarded = {t.label.split("/")[1]: t.gpu_minors for t in targets()}
    assert guarded == {"zero": None, "zero-mig": None, "unoffered": None, "junk": None}  # no NVIDIA device
    (exempt,) = targets.exemptions()
    assert (exempt.pod, exempt.reason.split(" (")[0]) == ("real", "nvidia.com/gpu: 1")
    targets()
    refused = sorted((n, r) for n, r, _ in events.pods)
    assert refused == [(n, EXEMPTION_REFUSED) for n in ("junk", "unoffered", "zero", "zero-mig")]
    assert "quantity above zero" in events.pods[0][2]


def test_without_the_node_no_pod_is_exempt_for_another_plugin() -> None:
    gpus = make_gpus()
    real = gpu_plugin_pod("real", "nvidia.com/gpu", "1")
    unknown = GuardTargets(cache(real), Ledger(gpus), gpus, node_resources=lambda: None)
    with pytest.raises(TargetsNotReadyError):  # the node not seen yet: the guard keeps its rules
        unknown()
    closed = GuardTargets(cache(real), Ledger(gpus), gpus)  # no node source at all: fail closed
    assert [t.label.split("/")[1] for t in closed()] == ["real"]
    assert closed.exemptions() == []


def test_exemptions_say_why() -> None:
    gpus = make_gpus()
    agent = started("vcuda-agent-x", "kube-system", exempt=False)
    dcgm = started("dcgm", "monitoring", exempt=True)
    targets = GuardTargets(
        cache(agent, dcgm), Ledger(gpus), gpus, agent.uid, exempt_namespaces=frozenset({"monitoring"})
    )
    targets()
    reasons = {e.pod: e.reason for e in targets.exemptions()}
    assert reasons["vcuda-agent-x"].startswith("the agent's own pod")
    assert "--guard-exempt-namespaces" in reasons["dcgm"]


def test_the_pod_policy_for_the_gate() -> None:
    gpus = make_gpus()
    ledger = Ledger(gpus)
    shared = started("shared", "team-a", exempt=False)
    plain = started("plain", "team-a", exempt=False)
    agent = started("vcuda-agent-x", "kube-system", exempt=False)
    real = gpu_plugin_pod("real", "nvidia.com/gpu", "1")
    zero = gpu_plugin_pod("zero", "nvidia.com/gpu", "0")
    ledger.assign(Assignment(shared.uid, "team-a", "shared", "main", False, (1,), 30, 1024))
    ledger.assign(Assignment("not-listed-yet", "team-a", "new", "main", False, (0,), 30, 1024))
    targets = GuardTargets(
        cache(shared, plain, agent, real, zero),
        ledger,
        gpus,
        agent.uid,
        node_resources=lambda: NODE_RESOURCES,
    )
    assert targets.pod_policy(shared.uid) == DevicePolicy(frozenset({1}))
    assert targets.pod_policy(plain.uid) == DevicePolicy(None)
    assert targets.pod_policy(zero.uid) == DevicePolicy(None)
    assert targets.pod_policy(agent.uid) is None and targets.pod_policy(real.uid) is None
    # Allocate named the pod before the cache saw it: its GPUs, nothing else.
    assert targets.pod_policy("not-listed-yet") == DevicePolicy(frozenset({0}))
    assert targets.pod_policy("unknown") == DevicePolicy(None)
    assert targets.settled()
    # Before the pod cache has synced (the agent's first instant) the gate fails closed:
    # the ledger's GPUs for a pod Allocate named, no NVIDIA device for any other.
    unsynced = cache(shared)
    unsynced.stats = lambda: SimpleNamespace(synced=False)
    unsynced.get = lambda uid: None
    early = GuardTargets(unsynced, ledger, gpus)
    assert not early.settled()
    assert early.pod_policy("unknown") == DevicePolicy(None)
    assert early.pod_policy("not-listed-yet") == DevicePolicy(frozenset({0}))
    # Before the Node has been seen, another plugin's GPUs exempt nobody yet (nor is the pod
    # told that they do not count: that is decided once they can be checked).
    unseen = GuardTargets(cache(real), ledger, gpus, node_resources=lambda: None)
    assert not unseen.settled()
    assert unseen.pod_policy(real.uid) == DevicePolicy(None)
