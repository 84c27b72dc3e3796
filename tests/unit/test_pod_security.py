"""MPS v3 trust from the pod spec: a container gets a namespace grant only if its spec proves
it can neither run as root nor become root; everything else (absent, malformed, privileged)
is "may be root" and gets no MPS grant at Allocate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.control.mpssharing import MpsSharing
from agent.control.mpstrust import SpecRefusals
from agent.domain.ledger import Assignment
from agent.domain.requests import ResolvedRequest
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.kube.pods import pod_from_json
from agent.platform.kube.podsecurity import root_risk
from agent.platform.mpsv3 import MpsCapability
from agent.settings import SharingMode, SharingSettings
from agent.surfaces.sharingnode import container_root_risk

SAFE = {"runAsUser": 1000, "runAsNonRoot": True, "allowPrivilegeEscalation": False}


def pod(pod_sc: Any = None, ctr_sc: Any = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "resources": {"limits": {"nvidia.com/vcuda-core": "30"}}}
    if ctr_sc is not None:
        container["securityContext"] = ctr_sc
    spec: dict[str, Any] = {"containers": [container], "initContainers": [dict(container, name="i")]}
    if pod_sc is not None:
        spec["securityContext"] = pod_sc
    return {"metadata": {"uid": "u1", "name": "p"}, "spec": spec}


def risk(pod_sc: Any = None, ctr_sc: Any = None) -> str | None:
    parsed = pod_from_json(pod(pod_sc, ctr_sc))
    assert parsed.containers[0].root_risk == parsed.containers[1].root_risk  # init containers too
    return container_root_risk(parsed, "c")


def test_a_container_that_proves_it_is_not_root_is_trusted() -> None:
    assert risk(None, SAFE) is None
    assert risk(None, {"runAsUser": 1000, "allowPrivilegeEscalation": False}) is None
    # runAsNonRoot alone: the kubelet refuses an image whose user is root
    assert risk(None, {"runAsNonRoot": True, "allowPrivilegeEscalation": False}) is None
    # pod-level user, container-level escalation (no pod-level field for it)
    assert risk({"runAsUser": 1000, "runAsNonRoot": True}, {"allowPrivilegeEscalation": False}) is None


@pytest.mark.parametrize(
    ("pod_sc", "ctr_sc", "said"),
    [
        (None, None, "no runAsNonRoot/runAsUser and allowPrivilegeEscalation: false"),
        # the pod says non-root, the container overrides its user with 0
        ({"runAsNonRoot": True, "runAsUser": 1000}, {**SAFE, "runAsUser": 0}, "runAsUser: 0"),
        ({"runAsUser": 1000}, {}, "allowPrivilegeEscalation is not false"),  # escalation missing
        (None, {**SAFE, "allowPrivilegeEscalation": True}, "allowPrivilegeEscalation is not false"),
        (None, {**SAFE, "privileged": True}, "privileged"),
        (None, {**SAFE, "capabilities": {"add": ["CAP_SYS_ADMIN"]}}, "SYS_ADMIN"),
        (None, {**SAFE, "capabilities": {"add": ["all"]}}, "SYS_ADMIN"),
        (None, {**SAFE, "runAsNonRoot": False, "runAsUser": None}, "no runAsNonRoot/runAsUser"),
        # malformed: never a crash, never trusted
        (None, {**SAFE, "runAsUser": "1000"}, "is not a user id"),
        (None, {**SAFE, "runAsUser": True}, "is not a user id"),
        (None, {**SAFE, "runAsUser": -1}, "is not a user id"),
        (None, {"runAsNonRoot": "true", "allowPrivilegeEscalation": False}, "is not a boolean"),
        (None, {**SAFE, "allowPrivilegeEscalation": "false"}, "allowPrivilegeEscalation is not false"),
        (None, {**SAFE, "privileged": "no"}, "privileged"),
        (None, {**SAFE, "capabilities": ["SYS_ADMIN"]}, "capabilities malformed"),
        (None, {**SAFE, "capabilities": {"add": "SYS_ADMIN"}}, "capabilities malformed"),
        ("root", SAFE, "pod securityContext is not an object"),
        (None, ["runAsUser", 1000], "securityContext is not an object"),
    ],
)
def test_anything_else_may_be_root(pod_sc: Any, ctr_sc: Any, said: str) -> None:
    why = risk(pod_sc, ctr_sc)
    assert why is not None and said in why, why
    assert why == root_risk(pod_sc, ctr_sc)


def test_a_pod_or_container_the_agent_has_not_seen_may_be_root() -> None:
    assert "no pod spec seen" in (container_root_risk(None, "c") or "")
    assert "no pod spec seen" in (container_root_risk(pod_from_json(pod(None, SAFE)), "other") or "")


GPU = GpuInfo(0, "GPU-0", "NVIDIA H100 80GB HBM3", 81559, 0, "00000000:18:00.0", 0)


def test_on_v3_a_share_that_may_be_root_gets_no_mps_grant_and_status_says_why(tmp_path: Path) -> None:
    risks = {"root": "may run as root (no runAsNonRoot/runAsUser and allowPrivilegeEscalation: false)"}
    sharing = MpsSharing(
        SharingSettings(mode=SharingMode.MPS, mps_root=tmp_path),
        gpus=[GPU],
        command=["/nonexistent/nvidia-cuda-mps-control"],
        mode=lambda: SharingMode.MPS,
        capability=MpsCapability(True, "test", {0: False}),
        root_risk=lambda a: risks.get(a.pod_uid),
    )
    assignment = Assignment("root", "default", "root", "c", False, (0,), 30, 0)
    assert sharing.grant_for(ResolvedRequest(30, (GPU,)), assignment) is None
    why = sharing.refused("root", "c") or ""
    assert "may run as root" in why and "time-sliced and held by the freezer" in why, why
    assert sharing.refused("other", "c") is None
    sharing.forget(set())
    assert sharing.refused("root", "c") is None  # gone with its ledger entry


def test_a_gpu_holding_a_time_sliced_share_stays_time_sliced_until_it_leaves() -> None:
    refusals = SpecRefusals()
    assert "may run as root" in (refusals.decide("root/c", 0, "may run as root (x)", []) or "")
    # a non-root share on the same GPU: its daemon could not attach beside a plain context
    beside = refusals.decide("user/c", 0, None, [])
    assert beside is not None and "GPU 0 holds root/c, time-sliced" in beside, beside
    assert refusals.decide("other/c", 1, None, []) is None  # another GPU is not concerned
    refusals.keep(lambda k: k == "other/c")  # both left the ledger
    assert refusals.decide("user/c", 0, None, []) is None and refusals.why("root/c") is None


def test_a_root_share_on_a_gpu_that_serves_mps_clients_is_told_what_happens_to_it() -> None:
    refusals = SpecRefusals()
    why = refusals.decide("root/c", 0, "may run as root (x)", ["user/c"]) or ""
    assert "already serves MPS clients, user/c" in why and "EXCLUSIVE_PROCESS" in why, why
    # the next non-root share joins the daemon's clients
    assert refusals.decide("user2/c", 0, None, ["user/c"]) is None
