"""Device-guard exemptions decided from what the (emulated) API server holds: the pod cache
and the watched Node, through the real kubernetes client. A pod naming another plugin's GPU
at quantity zero (``nvidia.com/gpu: "0"`` fits any node) is guarded; one granted a GPU the
node offers is left to that plugin."""

from __future__ import annotations

from typing import Any

from kubernetes.client import ApiClient

from agent.control.guardtargets import EXEMPTION_REFUSED, GuardTargets
from agent.domain.ledger import Ledger
from agent.emulators.apiserver import FakeApiServer
from agent.platform.kube.nodes import NodeWatch, offered_resources
from agent.platform.kube.podcache import PodCache
from tests.integration.kubeapi import NODE, apiserver, kube, pod_manifest, running, wait_until
from tests.unit.kubefixtures import make_gpus

__all__ = ["apiserver", "kube"]  # fixtures


def plugin_pod(name: str, resource: str, quantity: str) -> dict[str, Any]:
    manifest = pod_manifest(name, cores=None, namespace="team-a")
    manifest["spec"]["containers"][0]["resources"]["limits"] = {resource: quantity}
    return manifest


class RecordedEvents:
    def __init__(self) -> None:
        self.reasons: list[tuple[str, str]] = []

    def pod(self, pod: object, reason: str, message: str, warning: bool = True) -> None:
        self.reasons.append((getattr(pod, "name", ""), reason))

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        raise AssertionError("pod Events only")


def test_a_zero_quantity_gpu_pod_is_guarded_and_a_granted_one_is_exempt(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    apiserver.create_node(NODE, capacity={"nvidia.com/gpu": "2"}, allocatable={"nvidia.com/gpu": "2"})
    for name, quantity in (("zero", "0"), ("granted", "1")):
        apiserver.create_pod(plugin_pod(name, "nvidia.com/gpu", quantity))
        apiserver.set_pod_phase("team-a", name, "Running", {"main": f"containerd://{name}-{'0' * 58}"})
    pods = PodCache(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)
    node = NodeWatch(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)
    gpus = make_gpus()
    events = RecordedEvents()
    targets = GuardTargets(
        pods, Ledger(gpus), gpus, events=events, node_resources=lambda: offered_resources(node.current())
    )
    with running(pods.run, "pod-cache"), running(node.run, "node-watch"):
        assert pods.wait_synced(10)
        wait_until(node.current, 10, "the node")
        wait_until(
            lambda: len(pods.pods()) == 2 and all(c.container_id for p in pods.pods() for c in p.containers)
        )
        guarded = {t.label: t.gpu_minors for t in targets()}
        assert guarded == {"team-a/zero/main": None}  # no NVIDIA device at all
        assert [(e.pod, e.reason.split(" (")[0]) for e in targets.exemptions()] == [
            ("granted", "nvidia.com/gpu: 1")
        ]
        assert events.reasons == [("zero", EXEMPTION_REFUSED)]
        # The node stops offering the resource: the granted pod loses its exemption too.
        apiserver.zero_extended_resources(NODE)
        wait_until(lambda: (offered_resources(node.current()) or {}).get("nvidia.com/gpu") == "0", 10)
        assert {t.label for t in targets()} == {"team-a/zero/main", "team-a/granted/main"}
