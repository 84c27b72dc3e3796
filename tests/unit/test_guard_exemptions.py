"""Device-guard exemptions are the admin's: the annotation counts only in the namespaces
the agent was told (--guard-exempt-namespaces); elsewhere it is refused with one Event."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from agent.control.guardtargets import EXEMPT_ANNOTATION, EXEMPTION_REFUSED, GuardTargets
from agent.domain.ledger import Ledger
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
    return SimpleNamespace(pods=lambda: list(pods), stats=lambda: SimpleNamespace(synced=True))


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
