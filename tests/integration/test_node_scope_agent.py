"""deploy/base/node-scope-policy.yaml against what a running agent really writes: the agent
process, the fake API server (real kubernetes client, real HTTP) and the kubelet emulator. Every
pod and Node write the agent makes, taken with the object before and after it as admission sees
them, is admitted for the agent on its own node and refused for an agent on another node. A key
the agent starts writing that the policy does not list fails here."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from agent.domain.annotations import GPU_ASSIGNED, PREDICATE_NODE, PREDICATE_TIME, predicate_key
from agent.domain.nodeinventory import (
    CAPACITY_RESOURCE,
    COUNT_LABEL,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
)
from tests.conftest import AgentProcess
from tests.integration.kubecluster import NODE, Cluster, pod_annotations, pod_manifest, wait_until
from tests.unit.admission_policy import AdmissionPolicy, Decision, admission_request, agent_extra, load_policy

GIB = 1024


@dataclass(frozen=True)
class Write:
    resource: str  # "pods", "nodes" or "nodes/status"
    old: dict[str, Any]
    new: dict[str, Any]

    def review(self, policy: AdmissionPolicy, node: str) -> Decision:
        subresource = self.resource.partition("/")[2]
        request = admission_request(self.new, self.old, extra=agent_extra(node), subresource=subresource)
        return policy.review(request, self.new, self.old)

    def changed_keys(self) -> set[str]:
        """Label, annotation and status capacity/allocatable keys this write changed."""
        pairs = [
            (self.old["metadata"].get(f), self.new["metadata"].get(f)) for f in ("labels", "annotations")
        ]
        pairs += [
            (self.old.get("status", {}).get(f), self.new.get("status", {}).get(f))
            for f in ("capacity", "allocatable")
        ]
        return {k for old, new in pairs for k in _changed(old or {}, new or {})}


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> set[str]:
    return {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}


@pytest.fixture
def agent_writes(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Write]]:
    """Pod and Node writes that come in over HTTP (the agent's: the emulators and this test
    write through Python calls), each with the stored object before and after it."""
    over_http = threading.local()  # set in the server's request threads only
    record_request = cluster.api.record_request

    def marked(method: str, path: str, query: dict[str, str]) -> Any:
        over_http.active = True
        return record_request(method, path, query)

    store = cluster.api.store
    update = store.update
    writes: list[Write] = []
    lock = threading.Lock()

    def observed(
        resource: str,
        namespace: str,
        name: str,
        change: Callable[[dict[str, Any]], Any],
        sub: str | None = None,
    ) -> dict[str, Any]:
        before: list[dict[str, Any]] = []

        def seen(current: dict[str, Any]) -> Any:
            before.append(copy.deepcopy(current))  # under the store's lock: what the write applied to
            return change(current)

        after = update(resource, namespace, name, seen, sub)
        if getattr(over_http, "active", False) and resource in ("pods", "nodes") and before:
            with lock:
                writes.append(Write(resource + (f"/{sub}" if sub else ""), before[0], copy.deepcopy(after)))
        return after

    monkeypatch.setattr(cluster.api, "record_request", marked)
    monkeypatch.setattr(store, "update", observed)
    yield writes


def published(cluster: Cluster) -> bool:
    node = cluster.api.node(NODE) or {}
    status, meta = node.get("status") or {}, node.get("metadata") or {}
    return (
        all(
            (status.get(f) or {}).get(CAPACITY_RESOURCE) not in (None, "0")
            for f in ("capacity", "allocatable")
        )
        and INVENTORY_ANNOTATION in (meta.get("annotations") or {})
        and PRODUCT_LABEL in (meta.get("labels") or {})
    )


def test_every_pod_and_node_write_of_a_running_agent_passes_the_policy(
    start_agent: Callable[..., AgentProcess], cluster: Cluster, agent_writes: list[Write]
) -> None:
    start_agent("2xH100-80GB", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    cluster.node.run_pod(
        pod_manifest("multi", ("a", 30, GIB), ("b", 40, 2 * GIB), init=(("setup", 20, GIB),))
    )
    wait_until(
        lambda: pod_annotations(cluster.api, "multi").get(GPU_ASSIGNED) == "true", what="pod annotated"
    )
    wait_until(lambda: published(cluster), what="GPU offer published")
    cluster.api.zero_extended_resources(NODE)  # kubelet on a re-created node: the agent re-asserts
    wait_until(lambda: published(cluster), what="capacity re-asserted")

    writes = list(agent_writes)  # a snapshot: the agent goes on writing
    policy = load_policy()
    keys: dict[str, set[str]] = {"pods": set(), "nodes": set(), "nodes/status": set()}
    for write in writes:
        decision = write.review(policy, NODE)
        assert decision.allowed and not decision.errors, f"{write.resource} write refused: {decision}"
        keys[write.resource] |= write.changed_keys()
        other = write.review(policy, "gpu-node-2")
        assert other.matched and not other.allowed, f"an agent on another node may write {write}"
    init_and_apps = {predicate_key(0, init=True), predicate_key(0, init=False), predicate_key(1, init=False)}
    assert keys["pods"] >= {GPU_ASSIGNED, PREDICATE_NODE, PREDICATE_TIME} | init_and_apps
    assert keys["nodes"] >= {PRODUCT_LABEL, COUNT_LABEL, MEMORY_LABEL, INVENTORY_ANNOTATION}
    assert keys["nodes/status"] == {CAPACITY_RESOURCE}

    # The check bites: the agent's own pod write plus one foreign annotation is refused.
    pod_write = next(w for w in writes if w.resource == "pods")
    tampered = copy.deepcopy(pod_write.new)
    tampered["metadata"].setdefault("annotations", {})["example.com/owner"] = "agent"
    decision = Write("pods", pod_write.old, tampered).review(policy, NODE)
    assert not decision.allowed and "example.com/owner" in " ".join(decision.refusals)
