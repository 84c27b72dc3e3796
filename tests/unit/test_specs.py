"""Enforcement specs: cap, quota and policy from the ledger, pod annotations and node label."""

from __future__ import annotations

import pytest

from agent.domain.annotations import Policy
from agent.domain.ledger import Assignment
from agent.domain.specs import SpecBounds, build_spec, node_policy
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import container, make_pod


def share_of(pod: PodInfo, cores: int = 50, memory: int = 2048) -> Assignment:
    return Assignment(pod.uid, pod.namespace, pod.name, "c", False, (1,), cores, memory)


def test_a_share_without_annotations_is_capped_at_its_request_under_the_node_default() -> None:
    pod = make_pod("p", container("c", 50, 2048))
    spec = build_spec(share_of(pod), pod, Policy.BURST_SHARE)
    assert (spec.gpus, spec.cores, spec.cap, spec.memory_quota_mib) == ((1,), 50, 50, 2048)
    assert spec.policy is Policy.BURST_SHARE and spec.problems == () and not spec.whole


def test_limit_and_policy_annotations_apply_within_the_nodes_bounds() -> None:
    pod = make_pod(
        "p",
        container("c", 30, 2048),
        annotations={"nvidia.com/vcuda-core-limit": "80", "nvidia.com/vcuda-policy": "best-effort"},
    )
    spec = build_spec(share_of(pod, cores=30), pod, Policy.FIXED_SHARE, SpecBounds(frozenset(Policy), 100))
    assert (spec.cap, spec.policy, spec.bounded) == (80, Policy.BEST_EFFORT, ())


def test_by_default_a_pod_cannot_choose_best_effort_nor_a_fixed_cap_above_its_request() -> None:
    """The tenant escapes: best-effort is never throttled; a fixed-share limit of 100 on a
    request of 10 takes the GPU the scheduler booked for others."""
    greedy = make_pod("g", container("c", 10, 1024), annotations={"nvidia.com/vcuda-policy": "best-effort"})
    spec = build_spec(share_of(greedy, cores=10), greedy, Policy.FIXED_SHARE)
    assert (spec.policy, spec.cap) == (Policy.FIXED_SHARE, 10)
    assert "not allowed on this node" in spec.bounded[0] and spec.problems == ()
    taker = make_pod("t", container("c", 10, 1024), annotations={"nvidia.com/vcuda-core-limit": "100"})
    spec = build_spec(share_of(taker, cores=10), taker, Policy.FIXED_SHARE)
    assert (spec.policy, spec.cap) == (Policy.FIXED_SHARE, 10)
    assert "capping at 10" in spec.bounded[0]
    both = make_pod(
        "b",
        container("c", 10, 1024),
        annotations={"nvidia.com/vcuda-policy": "best-effort", "nvidia.com/vcuda-core-limit": "100"},
    )
    spec = build_spec(share_of(both, cores=10), both, Policy.FIXED_SHARE, SpecBounds(max_limit_ratio=2.5))
    assert (spec.policy, spec.cap, len(spec.bounded)) == (Policy.FIXED_SHARE, 25, 2)


def test_burst_share_keeps_its_limit_and_the_node_default_is_the_admins() -> None:
    """A burst-share limit only lowers its ceiling (without one it may use 100): nothing to
    bound. A node labelled best-effort by the admin is not a pod's choice."""
    pod = make_pod(
        "p",
        container("c", 10, 1024),
        annotations={"nvidia.com/vcuda-policy": "burst-share", "nvidia.com/vcuda-core-limit": "60"},
    )
    spec = build_spec(share_of(pod, cores=10), pod, Policy.FIXED_SHARE)
    assert (spec.policy, spec.cap, spec.ceiling, spec.bounded) == (Policy.BURST_SHARE, 60, 60, ())
    plain = make_pod("q", container("c", 10, 1024))
    spec = build_spec(share_of(plain, cores=10), plain, Policy.BEST_EFFORT)
    assert (spec.policy, spec.bounded) == (Policy.BEST_EFFORT, ())


@pytest.mark.parametrize(
    ("limit", "why"),
    [
        ("abc", "not a number"),
        ("0", "out of range"),
        ("250", "out of range"),
        ("-10", "out of range"),
        ("20", "out of range"),
    ],
)
def test_an_invalid_limit_gives_the_safe_default_and_says_why(limit: str, why: str) -> None:
    pod = make_pod(
        "p",
        container("c", 50, 2048),
        annotations={"nvidia.com/vcuda-core-limit": limit, "nvidia.com/vcuda-policy": "burst-share"},
    )
    spec = build_spec(share_of(pod), pod, Policy.BEST_EFFORT)
    assert (spec.cap, spec.policy) == (50, Policy.FIXED_SHARE)
    assert len(spec.problems) == 1
    assert (
        why in spec.problems[0]
        and repr(limit) in spec.problems[0]
        and "from the request (50) to 100" in spec.problems[0]
    )


def test_an_invalid_policy_gives_the_safe_default() -> None:
    pod = make_pod("p", container("c", 50, 2048), annotations={"nvidia.com/vcuda-policy": "turbo"})
    spec = build_spec(share_of(pod), pod, Policy.BURST_SHARE)
    assert (spec.cap, spec.policy) == (50, Policy.FIXED_SHARE)
    assert "'turbo' is not a policy (valid: fixed-share, burst-share, best-effort)" in spec.problems[0]


def test_whole_gpus_have_no_cap_and_no_quota() -> None:
    pod = make_pod("w", container("c", 200), annotations={"nvidia.com/vcuda-core-limit": "abc"})
    item = Assignment(pod.uid, "default", "w", "c", False, (0, 1), 200, 0)
    spec = build_spec(item, pod, Policy.FIXED_SHARE)
    assert (spec.cap, spec.memory_quota_mib, spec.whole, spec.problems) == (None, None, True, ())


def test_the_container_id_comes_from_the_pod_status() -> None:
    raw_pod = make_pod("p", container("c", 50, 2048))
    started = PodInfo(
        **{
            **raw_pod.__dict__,
            "containers": (
                raw_pod.containers[0].__class__(
                    **{**raw_pod.containers[0].__dict__, "container_id": "abc", "runtime": "containerd"}
                ),
            ),
        }
    )
    spec = build_spec(share_of(started), started, Policy.FIXED_SHARE)
    assert (spec.container_id, spec.runtime) == ("abc", "containerd")
    assert build_spec(share_of(raw_pod), None, Policy.FIXED_SHARE).container_id == ""


@pytest.mark.parametrize(
    ("label", "policy", "problem"),
    [
        (None, Policy.FIXED_SHARE, False),
        ("burst-share", Policy.BURST_SHARE, False),
        ("nope", Policy.FIXED_SHARE, True),
    ],
)
def test_node_default_policy_from_the_label(label: str | None, policy: Policy, problem: bool) -> None:
    got, why = node_policy(label, "n1")
    assert got is policy and bool(why) is problem
