"""deploy/base/node-scope-policy.yaml, its CEL expressions evaluated as written (cel-python, see
admission_policy.py) against AdmissionRequest-style input: the node agent may change only pods
bound to its own node and its own Node, and there only the keys the agent's code writes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

import pytest
import yaml

from agent.control import guardtargets
from agent.domain import annotations as annotation_keys
from agent.domain import nodeinventory
from agent.domain.annotations import (
    CORE_LIMIT,
    GPU_ASSIGNED,
    ISOLATION,
    POLICY,
    PREDICATE_IDX,
    PREDICATE_IDX_INIT,
    PREDICATE_NODE,
    PREDICATE_TIME,
    predicate_key,
)
from agent.domain.nodeinventory import (
    CAPACITY_RESOURCE,
    COUNT_LABEL,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
    gpu_labels,
)
from agent.platform.gpu.inventory import GpuInfo
from tests.unit.admission_objects import NODE, OTHER, merge, node, patched, pod, vcuda_memory
from tests.unit.admission_policy import (
    AGENT_USER,
    NODE_NAME_EXTRA,
    NODE_SCOPE_POLICY,
    ROOT,
    AdmissionPolicy,
    Decision,
    Doc,
    admission_request,
    agent_extra,
    load_documents,
    load_policy,
)

OWN_TOKEN = agent_extra(NODE)
# What each key constant is to the agent. A new constant must be put in one of these, and the
# tests below then check that the policy lets the agent write it, or refuses it.
POD_ANNOTATIONS_WRITTEN = {GPU_ASSIGNED, PREDICATE_NODE, PREDICATE_TIME, PREDICATE_IDX, PREDICATE_IDX_INIT}
NODE_KEYS_WRITTEN = {INVENTORY_ANNOTATION, PRODUCT_LABEL, COUNT_LABEL, MEMORY_LABEL}
NODE_STATUS_WRITTEN = {CAPACITY_RESOURCE}
READ_ONLY = {CORE_LIMIT, POLICY, ISOLATION, guardtargets.EXEMPT_ANNOTATION}  # the tenant's or the admin's
# What Allocate and recovery write on a pod (control/allocations.py, control/recovery.py), keys from the code.
POD_WRITES: dict[str, str | None] = {
    predicate_key(0, init=False): "0",
    predicate_key(1, init=False): "0,1",
    predicate_key(12, init=False): "3",
    predicate_key(0, init=True): "1",
    PREDICATE_NODE: NODE,
    PREDICATE_TIME: "1736000000123456789",
    GPU_ASSIGNED: "true",
}
GPUS = [
    GpuInfo(i, f"GPU-{i:08d}-1111-2222-3333-444444444444", "NVIDIA H100 80GB HBM3", 81559, i, f"0:{i}", 0)
    for i in range(4)
]


@cache
def policy() -> AdmissionPolicy:
    return load_policy()


def review(
    new: Doc,
    old: Doc,
    *,
    user: str = AGENT_USER,
    extra: Mapping[str, list[str]] | None = OWN_TOKEN,
    subresource: str = "",
) -> Decision:
    request = admission_request(new, old, username=user, extra=extra, subresource=subresource)
    return policy().review(request, new, old)


def allowed(decision: Decision) -> bool:
    assert decision.matched and not decision.errors, decision
    return decision.allowed


def refused(decision: Decision, *words: str) -> bool:
    """Refused, with no evaluation error, and a message naming each of ``words``."""
    assert decision.matched and not decision.errors, decision
    text = " | ".join(decision.refusals)
    missing = [w for w in words if w not in text]
    assert not missing, f"{missing} not in {text!r}"
    return not decision.allowed


# ---- the policy's shape -------------------------------------------------------------------


def test_the_policy_is_bound_with_deny_and_in_the_base() -> None:
    docs = load_documents()
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    spec = docs[0]["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert docs[1]["spec"] == {"policyName": docs[0]["metadata"]["name"], "validationActions": ["Deny"]}
    kustomization = yaml.safe_load((ROOT / "deploy/base/kustomization.yaml").read_text())
    assert NODE_SCOPE_POLICY.name in kustomization["resources"]
    assert policy().expressions(), "every expression parsed"


def test_the_policy_names_the_service_account_the_agent_runs_as() -> None:
    """A renamed or moved ServiceAccount would leave the policy matching no one: fail here."""
    rbac = list(yaml.safe_load_all((ROOT / "deploy/base/rbac.yaml").read_text()))
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]
    daemonset = yaml.safe_load((ROOT / "deploy/base/daemonset.yaml").read_text())
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    assert f"system:serviceaccount:{account['namespace']}:{account['name']}" == AGENT_USER
    old = pod()
    assert review(patched(old, merge("labels", {"x": "y"})), old, user=AGENT_USER).matched


def test_every_pod_and_node_write_rbac_grants_the_agent_is_matched() -> None:
    """A write verb added to rbac.yaml for pods or Nodes without widening the policy fails here.
    Events stay with RBAC alone: they change no pod or Node."""
    rbac = yaml.safe_load_all((ROOT / "deploy/base/rbac.yaml").read_text())
    role = next(d for d in rbac if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "vcuda-agent")
    operations = {"patch": "UPDATE", "update": "UPDATE", "create": "CREATE", "delete": "DELETE"}
    checked = set()
    for rule in role["rules"]:
        for resource in rule["resources"]:
            name, _, sub = resource.partition("/")
            if name not in ("pods", "nodes"):
                continue
            for verb in set(rule["verbs"]) - {"get", "list", "watch"}:
                obj = pod() if name == "pods" else node()
                request = admission_request(obj, obj, subresource=sub, operation=operations[verb])
                assert policy().selects(request), f"{verb} {resource} is granted but not checked"
                checked.add(resource)
    assert checked == {"pods", "nodes", "nodes/status"}


def test_every_key_constant_is_classified() -> None:
    """The keys the code knows; a new one fails here until it is put in a set above."""
    found = {
        value
        for module in (annotation_keys, nodeinventory, guardtargets)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and value.startswith("nvidia.com/")
    }
    assert found == POD_ANNOTATIONS_WRITTEN | NODE_KEYS_WRITTEN | NODE_STATUS_WRITTEN | READ_ONLY
    assert {k.rsplit("-", 1)[0] + "-" for k in POD_WRITES if k.startswith(PREDICATE_IDX)} == {
        PREDICATE_IDX,
        PREDICATE_IDX_INIT,
    }
    assert POD_ANNOTATIONS_WRITTEN - {PREDICATE_IDX, PREDICATE_IDX_INIT} <= set(POD_WRITES)


# ---- pods -----------------------------------------------------------------------------------


def test_the_agent_may_annotate_a_pod_on_its_node_as_allocate_does() -> None:
    old = pod()
    new = patched(old, merge("annotations", POD_WRITES))
    assert allowed(review(new, old))
    # recovery: a correction, and an assignment that was wrong
    assert allowed(review(patched(new, merge("annotations", {GPU_ASSIGNED: "false"})), new))
    assert allowed(review(patched(new, merge("annotations", dict.fromkeys(POD_WRITES))), new))


@pytest.mark.parametrize("key", sorted(POD_WRITES))
def test_each_pod_annotation_the_agent_writes_is_allowed_alone(key: str) -> None:
    bare = pod()
    del bare["metadata"]["annotations"]  # the first annotation of a pod that had none
    assert allowed(review(patched(bare, merge("annotations", {key: POD_WRITES[key]})), bare))


def test_a_pod_on_another_node_is_refused() -> None:
    old = pod(OTHER)
    new = patched(old, merge("annotations", {**POD_WRITES, PREDICATE_NODE: OTHER}))
    assert refused(review(new, old), f"on node {NODE}", f"pod ml/train-0 is on node {OTHER}")


def test_a_pod_bound_to_no_node_is_refused() -> None:
    old = pod(None)
    assert refused(review(patched(old, merge("annotations", POD_WRITES)), old), "bound to no node")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (merge("labels", {"app": "evil"}), "label(s) app"),
        (merge("labels", {"app": None}), "label(s) app"),
        (merge("labels", {GPU_ASSIGNED: "true"}), f"label(s) {GPU_ASSIGNED}"),
        (merge("annotations", {CORE_LIMIT: "100"}), f"annotation(s) {CORE_LIMIT}"),
        (merge("annotations", {POLICY: None}), f"annotation(s) {POLICY}"),
        (merge("annotations", {guardtargets.EXEMPT_ANNOTATION: "exempt"}), guardtargets.EXEMPT_ANNOTATION),
        (merge("annotations", {PREDICATE_IDX + "x": "0"}), PREDICATE_IDX + "x"),
        (merge("annotations", {PREDICATE_NODE: OTHER}), f"predicate-node of pod ml/train-0 to {OTHER}"),
        (lambda p: p["spec"]["containers"][0].update(image="evil:latest"), "may not change spec"),
        (lambda p: p["spec"].update(activeDeadlineSeconds=1), "spec"),
        (lambda p: p["metadata"].update(finalizers=["example.com/hold"]), "metadata.finalizers"),
        (lambda p: p["metadata"].pop("ownerReferences"), "metadata.ownerReferences"),
    ],
)
def test_other_changes_to_its_own_pod_are_refused_by_name(
    change: Callable[[Doc], object], named: str
) -> None:
    old = pod()
    new = patched(old, change)
    assert refused(review(new, old), named)
    # ... and also when they come with the agent's own annotations
    assert refused(review(patched(patched(old, merge("annotations", POD_WRITES)), change), old), named)


# ---- nodes ----------------------------------------------------------------------------------


def test_the_agent_may_publish_on_its_own_node_as_the_publisher_does() -> None:
    old = node()
    labels = gpu_labels(GPUS)
    assert set(labels) == {PRODUCT_LABEL, COUNT_LABEL, MEMORY_LABEL}
    metadata = patched(
        old, lambda n: (merge("labels", labels)(n), merge("annotations", {INVENTORY_ANNOTATION: "{}"})(n))
    )
    assert allowed(review(metadata, old))
    removed = patched(metadata, merge("labels", gpu_labels([])))  # a node left with no GPUs
    assert allowed(review(removed, metadata))
    status = patched(old, vcuda_memory("293612"))
    assert allowed(review(status, old, subresource="status"))
    assert allowed(review(patched(status, vcuda_memory("0", "allocatable")), status, subresource="status"))
    gone = patched(
        status, lambda n: [n["status"][f].pop(CAPACITY_RESOURCE) for f in ("capacity", "allocatable")]
    )
    assert allowed(review(gone, status, subresource="status"))


def test_another_node_is_refused() -> None:
    old = node(OTHER)
    assert refused(
        review(patched(old, merge("labels", gpu_labels(GPUS))), old), f"its own Node, not Node {OTHER}"
    )
    assert refused(review(patched(old, vcuda_memory("1")), old, subresource="status"), f"Node {OTHER}")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (merge("labels", {POLICY: "best-effort"}), f"label(s) {POLICY}"),
        (
            merge("labels", {"node-role.kubernetes.io/control-plane": ""}),
            "node-role.kubernetes.io/control-plane",
        ),
        (merge("labels", {"nvidia-device-enable": None}), "label(s) nvidia-device-enable"),
        (
            merge("annotations", {"node.alpha.kubernetes.io/ttl": "30"}),
            "annotation(s) node.alpha.kubernetes.io/ttl",
        ),
        (merge("annotations", {GPU_ASSIGNED: "true"}), f"annotation(s) {GPU_ASSIGNED}"),
        (lambda n: n["spec"].update(unschedulable=True), "may not change spec"),
        (lambda n: n["spec"].update(taints=[{"key": "k", "effect": "NoSchedule"}]), "spec"),
        (lambda n: n["metadata"].update(finalizers=["example.com/hold"]), "metadata.finalizers"),
        (lambda n: n["status"]["capacity"].update({"nvidia.com/gpu": "8"}), "status.capacity nvidia.com/gpu"),
        (lambda n: n["status"]["allocatable"].update(cpu="64"), "status.allocatable cpu"),
        (
            lambda n: n["status"]["capacity"].pop("nvidia.com/vcuda-core"),
            "status.capacity nvidia.com/vcuda-core",
        ),
        (lambda n: n["status"]["conditions"][0].update(status="False"), "status.conditions"),
        (
            lambda n: n["status"]["addresses"].append({"type": "ExternalIP", "address": "1.2.3.4"}),
            "status.addresses",
        ),
        (lambda n: n["status"].pop("images"), "status.images"),
    ],
)
def test_other_changes_to_its_own_node_are_refused_by_name(
    change: Callable[[Doc], object], named: str
) -> None:
    old = node()
    new = patched(old, change)
    assert refused(review(new, old), named)
    assert refused(review(new, old, subresource="status"), named)  # status can carry metadata too


# ---- who is asking --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        None,  # a token with no extras at all (a legacy Secret token)
        {k: v for k, v in OWN_TOKEN.items() if k != NODE_NAME_EXTRA},  # pod-bound, node info off
        {**OWN_TOKEN, NODE_NAME_EXTRA: []},
        {**OWN_TOKEN, NODE_NAME_EXTRA: [NODE, OTHER]},
    ],
    ids=["no-extra", "no-node-name", "empty-node-name", "two-node-names"],
)
def test_a_credential_that_names_no_single_node_is_refused(extra: dict[str, list[str]] | None) -> None:
    old_pod, old_node = pod(), node()
    assert refused(
        review(patched(old_pod, merge("annotations", POD_WRITES)), old_pod, extra=extra), "names no node"
    )
    assert refused(review(patched(old_node, vcuda_memory("1")), old_node, extra=extra, subresource="status"))


@pytest.mark.parametrize(
    "user",
    [
        f"system:node:{OTHER}",  # kubelet (the NodeRestriction plugin governs it)
        "system:serviceaccount:kube-system:vcuda-extender",  # the scheduler extender's predicate writes
        "system:serviceaccount:ml:vcuda-agent",  # same name, another namespace
        "kubernetes-admin",
    ],
)
def test_other_users_are_not_matched(user: str) -> None:
    old = pod(OTHER)
    new = patched(old, lambda p: (p["spec"].update(activeDeadlineSeconds=1), merge("labels", {"x": "y"})(p)))
    assert review(new, old, user=user, extra=None) == Decision(matched=False)
    old_node = node(OTHER)
    new_node = patched(old_node, lambda n: n["spec"].update(unschedulable=True))
    assert review(new_node, old_node, user=user, extra=agent_extra(NODE)) == Decision(matched=False)


def test_a_refusal_comes_from_the_policy_not_from_the_evaluator() -> None:
    """The same evaluator lets a clean write through: refusals above are the expressions' answers."""
    old = pod()
    new = patched(old, lambda p: None)
    assert review(new, old) == Decision(matched=True)
    request: Mapping[str, Any] = admission_request(new, old, extra=OWN_TOKEN, subresource="status")
    assert not policy().selects(request), "pods/status is not granted to the agent, nor matched"
