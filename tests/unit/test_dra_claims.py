"""An allocated ResourceClaim as GPU shares (agent/domain/dra.py) and those shares as ledger
entries for the containers that use the claim (agent/control/draledger.py), enforced through
the same specs and bounds as device-plugin allocations."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from agent.control.draledger import ClaimLedger, claim_entries, split
from agent.domain.annotations import Policy
from agent.domain.dra import DRIVER, ClaimError, ClaimRef, ClaimShare, PreparedMig, claim_ref, claim_shares
from agent.domain.ledger import Assignment, Ledger
from agent.domain.specs import SpecBounds, build_spec
from agent.platform.kube.pods import PodInfo, pod_from_json
from tests.unit.kubefixtures import make_gpus
from tests.unit.test_specbook_cache import Pods

NODE = "gpu-node"
CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "train-gpu", "namespace": "ml", "uid": "claim-1"},
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRIVER,
                        "pool": NODE,
                        "device": "gpu-1",
                        "shareID": "share-a",
                        "consumedCapacity": {"cores": "30", "memory": "4Gi"},
                    },
                    {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth1"},
                ],
                "config": [
                    {
                        "source": "FromClaim",
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": "gpu.vcuda.io/v1alpha1",
                                "kind": "ShareConfig",
                                "policy": "burst-share",
                                "limit": 50,
                            },
                        },
                    }
                ],
            }
        }
    },
}


def pod_json(
    name: str, claim: str, containers: Sequence[str], *, from_template: bool = False
) -> dict[str, Any]:
    source = {"resourceClaimTemplateName": "tpl"} if from_template else {"resourceClaimName": claim}
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": "gpu", **source}],
            "containers": [{"name": c, "resources": {"claims": [{"name": "gpu"}]}} for c in containers]
            + [{"name": "sidecar"}],
        },
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}
        if from_template
        else {},
    }


@dataclass(frozen=True)
class Prepared:
    ref: ClaimRef
    shares: tuple[ClaimShare, ...]
    mig: tuple[PreparedMig, ...] = ()


class Claims:
    def __init__(self, *claims: dict[str, Any]) -> None:
        self.items = [Prepared(claim_ref(c), tuple(claim_shares(c, NODE))) for c in claims]

    def prepared(self) -> list[Prepared]:
        return self.items


def test_an_allocated_claim_reads_as_its_share_with_its_config() -> None:
    [share] = claim_shares(CLAIM, NODE)
    assert (share.gpu_index, share.cores, share.memory_mib, share.share_id) == (1, 30, 4096, "share-a")
    assert (share.policy, share.limit, share.request) == ("burst-share", 50, "gpu")


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("pool",), "other-node", "not this node's pool"),
        (("device",), "eth0", "not a vcuda GPU device"),
        (("consumedCapacity", "cores"), "150", "expected 1..100"),
        (("consumedCapacity", "memory"), "lots", "consumedCapacity.memory"),
    ],
)
def test_a_claim_we_cannot_prepare_names_the_field(path: tuple[str, ...], value: str, message: str) -> None:
    claim = copy.deepcopy(CLAIM)
    target = claim["status"]["allocation"]["devices"]["results"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ClaimError, match=message):
        claim_shares(claim, NODE)


def test_an_unallocated_claim_is_refused() -> None:
    with pytest.raises(ClaimError, match=r"status\.allocation"):
        claim_shares({"metadata": CLAIM["metadata"], "status": {}}, NODE)


def test_split_never_exceeds_the_total() -> None:
    assert split(30, 2) == [15, 15] and split(10, 3) == [4, 3, 3] and sum(split(7, 5)) == 7


def test_the_containers_using_a_claim_share_it_evenly() -> None:
    pods = [pod_from_json(pod_json("a", "train-gpu", ["main", "helper"]))]
    entries = claim_entries(Claims(CLAIM).prepared(), pods)
    assert sorted((e.container, e.cores, e.memory_mib, e.gpus) for e in entries) == [
        ("helper", 15, 2048, (1,)),
        ("main", 15, 2048, (1,)),
    ]
    assert all(e.source == "dra" and e.policy == "burst-share" and e.limit == 50 for e in entries)


def test_a_claim_made_from_a_template_is_found_through_the_pod_status() -> None:
    pods = [pod_from_json(pod_json("b", "b-gpu-x7k2q", ["main"], from_template=True))]
    claim = copy.deepcopy(CLAIM)
    claim["metadata"]["name"] = "b-gpu-x7k2q"
    [entry] = claim_entries(Claims(claim).prepared(), pods)
    assert (entry.container, entry.cores) == ("main", 30)
    assert claim_entries(Claims(CLAIM).prepared(), pods) == []  # another claim: not this pod's


def test_the_claim_ledger_follows_prepare_and_unprepare() -> None:
    ledger = Ledger(make_gpus(2))
    pods = Pods()
    pod = pod_from_json(pod_json("a", "train-gpu", ["main"]))
    pods.by_uid[pod.uid] = pod
    claims = Claims(CLAIM)
    book = ClaimLedger(ledger, pods, claims)
    ledger.assign(Assignment("dp-pod", "default", "dp", "c", False, (1,), 60, 1024))  # the device plugin's
    assert book.sync() == 1 and book.sync() == 0
    assert sorted(a.cores for a in ledger.assignments()) == [30, 60]
    claims.items = []  # unprepared
    assert book.sync() == 1
    assert [a.pod for a in ledger.assignments()] == ["dp"]  # the device plugin's entry stays


def test_over_capacity_is_refused_not_double_counted() -> None:
    ledger = Ledger(make_gpus(2))
    pods = Pods()
    pod = pod_from_json(pod_json("a", "train-gpu", ["main"]))
    pods.by_uid[pod.uid] = pod
    ledger.assign(Assignment("dp-pod", "default", "dp", "c", False, (1,), 80, 1024))
    assert ClaimLedger(ledger, pods, Claims(CLAIM)).sync() == 0
    assert sum(a.cores for a in ledger.assignments()) == 80


def test_a_claims_config_is_bounded_like_an_annotation() -> None:
    [entry] = claim_entries(Claims(CLAIM).prepared(), [pod_from_json(pod_json("a", "train-gpu", ["main"]))])
    pod: PodInfo | None = None
    open_bounds = SpecBounds(frozenset(Policy), 100.0)
    assert build_spec(entry, pod, Policy.FIXED_SHARE, open_bounds).policy is Policy.BURST_SHARE
    fixed_only = SpecBounds(frozenset({Policy.FIXED_SHARE}), 1.0)
    spec = build_spec(entry, pod, Policy.FIXED_SHARE, fixed_only)
    assert spec.policy is Policy.FIXED_SHARE and spec.cap == 30 and spec.bounded


def test_every_container_of_a_claim_with_fewer_cores_than_containers_is_enforced() -> None:
    """A claim of 2 cores and 2 MiB used by three containers: a part of 0 used to leave the
    third without an entry (unthrottled, no memory quota). Each is capped at 1 core and 1 MiB
    at least, and the ledger still charges the GPU only what the claim consumed."""
    claim = copy.deepcopy(CLAIM)
    result = claim["status"]["allocation"]["devices"]["results"][0]
    result["consumedCapacity"] = {"cores": "2", "memory": "2Mi"}
    pod = pod_from_json(pod_json("a", "train-gpu", ["main", "helper", "logger"]))
    entries = claim_entries(Claims(claim).prepared(), [pod])
    assert sorted((e.container, e.cores, e.memory_mib) for e in entries) == [
        ("helper", 1, 1),
        ("logger", 1, 1),
        ("main", 1, 1),
    ]
    ledger = Ledger(make_gpus(2))
    pods = Pods()
    pods.by_uid[pod.uid] = pod
    # The GPU is otherwise full: 98 cores are the device plugin's, 2 are the claim's.
    ledger.assign(Assignment("dp-pod", "default", "dp", "c", False, (1,), 98, 1024))
    assert ClaimLedger(ledger, pods, Claims(claim)).sync() == 3
    held = {a.container for a in ledger.assignments() if a.source == "dra"}
    assert held == {"main", "helper", "logger"}
    usage = ledger.usage(1)
    assert (usage.cores, usage.memory_mib) == (100, 1024 + 2)


def test_a_config_for_the_main_request_applies_to_its_subrequests() -> None:
    """``requests: ["gpu"]`` configures every subrequest of ``gpu`` (``gpu/small``, allocated
    from firstAvailable); one naming the subrequest itself wins over it."""
    claim = copy.deepcopy(CLAIM)
    devices = claim["status"]["allocation"]["devices"]
    devices["results"][0]["request"] = "gpu/small"
    devices["results"].append({**devices["results"][0], "request": "gpu/large", "device": "gpu-0"})
    [share_small, share_large] = claim_shares(claim, NODE)
    assert (share_small.request, share_small.policy, share_small.limit) == ("gpu/small", "burst-share", 50)
    assert (share_large.request, share_large.policy, share_large.limit) == ("gpu/large", "burst-share", 50)
    exact = copy.deepcopy(devices["config"][0])
    exact["requests"] = ["gpu/large"]
    exact["opaque"]["parameters"] = {**exact["opaque"]["parameters"], "policy": "fixed-share", "limit": 20}
    devices["config"].append(exact)
    small, large = claim_shares(claim, NODE)
    assert (small.policy, large.policy, large.limit) == ("burst-share", "fixed-share", 20)
    other = copy.deepcopy(claim)
    other["status"]["allocation"]["devices"]["config"][0]["requests"] = ["gpux"]  # not a prefix match
    assert claim_shares(other, NODE)[0].policy is None
