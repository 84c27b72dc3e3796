"""deploy/overlays/dra/node-scope-policy.yaml, its CEL evaluated as written (admission_policy.py):
the agent may create, replace and delete only gpu.vcuda.io ResourceSlices of its own node."""

from __future__ import annotations

from typing import Any

import pytest

from agent.domain.dra import DRIVER
from tests.unit.admission_policy import AGENT_USER, ROOT, AdmissionPolicy, Decision, agent_extra, load_policy
from tests.unit.drafixtures import NODE, node_slice

POLICY = ROOT / "deploy" / "overlays" / "dra" / "node-scope-policy.yaml"
Doc = dict[str, Any]


def review(
    operation: str, obj: Doc | None, old: Doc | None, *, node: str | None = NODE, user: str = AGENT_USER
) -> Decision:
    target = obj if obj is not None else old
    assert target is not None
    gvr = {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"}
    userinfo: Doc = {
        "username": user,
        "uid": "u",
        "groups": ["system:serviceaccounts", "system:authenticated"],
    }
    if node is not None:
        userinfo["extra"] = agent_extra(node)
    request = {
        "uid": "r",
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"},
        "resource": gvr,
        "requestKind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"},
        "requestResource": gvr,
        "name": target["metadata"]["name"],
        "operation": operation,
        "userInfo": userinfo,
        "dryRun": False,
    }
    policy: AdmissionPolicy = load_policy(POLICY)
    return policy.review(request, obj, old)


def foreign_driver() -> Doc:
    obj = node_slice()
    obj["spec"]["driver"] = "gpu.nvidia.com"
    return obj


def test_the_agent_writes_its_own_nodes_slice() -> None:
    mine = node_slice()
    assert mine["spec"]["driver"] == DRIVER
    for operation, obj, old in (("CREATE", mine, None), ("UPDATE", mine, mine), ("DELETE", None, mine)):
        decision = review(operation, obj, old)
        assert decision.matched and decision.allowed, (operation, decision)


@pytest.mark.parametrize(
    ("operation", "obj", "old"),
    [
        ("CREATE", node_slice("gpu-node-2"), None),  # phantom GPUs on another node
        ("UPDATE", node_slice("gpu-node-2"), node_slice()),  # moving ours elsewhere
        ("UPDATE", node_slice(), node_slice("gpu-node-2")),  # taking over another node's
        ("DELETE", None, node_slice("gpu-node-2")),
        ("DELETE", None, foreign_driver()),  # another driver's slice on this node
        ("CREATE", foreign_driver(), None),
    ],
)
def test_other_nodes_and_drivers_are_refused(operation: str, obj: Doc | None, old: Doc | None) -> None:
    decision = review(operation, obj, old)
    assert decision.matched and not decision.allowed
    assert not decision.errors, decision.errors
    assert any("may only write ResourceSlices of gpu.vcuda.io on that node" in r for r in decision.refusals)


def test_a_token_without_a_node_is_refused_and_other_users_are_not_matched() -> None:
    decision = review("CREATE", node_slice(), None, node=None)
    assert not decision.allowed
    assert review("CREATE", node_slice("gpu-node-2"), None, user="system:serviceaccount:x:y").matched is False
