"""Which pod an Allocate is for: by age (kubelet's order), never by a pod's own annotations."""

from __future__ import annotations

import pytest

from agent.domain.annotations import GPU_ASSIGNED, PREDICATE_TIME
from agent.domain.ledger import Assignment, Ledger
from agent.domain.matching import (
    NoMatchingPodError,
    PredicateMismatchError,
    candidates,
    match,
    steer,
)
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import NODE, container, make_gpus, make_pod


def predicated(gpu: str, bound_ns: int, index: int = 0) -> dict[str, str]:
    return {f"nvidia.com/predicate-gpu-idx-{index}": gpu, PREDICATE_TIME: str(bound_ns)}


def pick(pods: list[PodInfo], size: int, gpus: tuple[int, ...], ledger: Ledger | None = None) -> str:
    ledger = ledger or Ledger(make_gpus(2))
    chosen = match(candidates(pods, NODE, ledger, size), len(pods), gpus=gpus, node_name=NODE)
    return f"{chosen.pod.name}/{chosen.container.name}"


def test_two_predicated_pods_with_equal_requests_oldest_pod_wins() -> None:
    young = make_pod(
        "young", container("c", 50, 1024), created="2026-11-22T11:00:00Z", annotations=predicated("0", 1000)
    )
    old = make_pod(
        "old", container("c", 50, 1024), created="2026-11-22T10:00:00Z", annotations=predicated("0", 2000)
    )
    assert pick([young, old], 50, (0,)) == "old/c"


def test_a_forged_predicate_time_does_not_move_a_pod_ahead() -> None:
    # predicate-time is writable by whoever edits the pod; kubelet admits
    # by creationTimestamp, which the API server sets.
    victim = make_pod("victim", container("c", 50, 1024), created="2026-01-01T00:00:00Z")
    tenant = make_pod(
        "tenant", container("c", 50, 1024), created="2026-01-01T00:00:05Z", annotations=predicated("0", 1)
    )
    assert pick([tenant, victim], 50, (0,)) == "victim/c"
    bound = make_pod(
        "bound", container("c", 50, 1024), created="2026-01-01T00:00:00Z", annotations=predicated("0", 9)
    )
    assert pick([tenant, bound], 50, (0,)) == "bound/c"


def test_the_candidate_whose_predicate_agrees_with_the_ids_wins() -> None:
    old = make_pod("old", container("c", 50, 1024), annotations=predicated("0", 1000))
    young = make_pod("young", container("c", 50, 1024), annotations=predicated("1", 2000))
    assert pick([old, young], 50, (1,)) == "young/c"


def test_a_pod_without_annotations_matches_by_size_and_age() -> None:
    small = make_pod("small", container("c", 30, 1024), created="2026-11-22T09:00:00Z")
    newer = make_pod("newer", container("c", 50, 1024), created="2026-11-22T11:00:00Z")
    older = make_pod("older", container("c", 50, 1024), created="2026-11-22T10:00:00Z")
    assert pick([small, newer, older], 50, (1,)) == "older/c"


def test_a_pod_marked_assigned_is_no_longer_a_candidate() -> None:
    # Still Pending (kubelet is starting it), but every GPU container was placed already.
    placed = make_pod("placed", container("c", 50, 1024), annotations={GPU_ASSIGNED: "true"})
    waiting = make_pod("waiting", container("c", 50, 1024), annotations={GPU_ASSIGNED: "false"})
    assert pick([placed, waiting], 50, (0,)) == "waiting/c"
    assert candidates([placed], NODE, Ledger(make_gpus(2)), 50) == []


def test_multi_container_pod_matches_its_next_unassigned_container() -> None:
    pod = make_pod("multi", container("a", 30, 1024), container("sidecar"), container("b", 30, 2048))
    ledger = Ledger(make_gpus(2))
    assert pick([pod], 30, (0,), ledger) == "multi/a"
    ledger.assign(Assignment(pod.uid, "default", "multi", "a", False, (0,), 30, 1024))
    assert pick([pod], 30, (0,), ledger) == "multi/b"
    ledger.assign(Assignment(pod.uid, "default", "multi", "b", False, (0,), 30, 2048))
    with pytest.raises(NoMatchingPodError):
        pick([pod], 30, (0,), ledger)


def test_init_containers_come_first_and_use_their_own_predicate_key() -> None:
    pod = make_pod(
        "with-init",
        container("app", 50, 1024),
        init=(container("setup", 20, 512),),
        annotations={"nvidia.com/predicate-gpu-idx-init-0": "1", "nvidia.com/predicate-gpu-idx-0": "0"},
    )
    ranked = candidates([pod], NODE, Ledger(make_gpus(2)), 20)
    assert [(c.container.name, c.container.init, c.predicated) for c in ranked] == [("setup", True, (1,))]
    assert candidates([pod], NODE, Ledger(make_gpus(2)), 50) == []  # app waits for its init container


def test_mismatch_between_predicate_and_ids_names_pod_container_and_both_gpus() -> None:
    pod = make_pod("placed", container("worker", 50, 1024), annotations=predicated("0", 1000))
    with pytest.raises(PredicateMismatchError) as err:
        pick([pod], 50, (1,))
    assert str(err.value) == (
        "pod default/placed container worker: the scheduler extender placed it on GPU 0 "
        "but kubelet allocated device IDs on GPU 1"
    )


def test_whole_gpu_predicates_compare_as_sets() -> None:
    pod = make_pod("big", container("c", 200), annotations=predicated("1,0", 1000))
    assert pick([pod], 200, (0, 1)) == "big/c"


@pytest.mark.parametrize(
    "pod",
    [
        make_pod("elsewhere", container("c", 50, 1024), node="other-node"),
        make_pod("running", container("c", 50, 1024), phase="Running"),
        make_pod("done", container("c", 50, 1024), phase="Succeeded"),
        make_pod("cpu-only", container("c")),
    ],
    ids=lambda p: p.name,
)
def test_pods_that_cannot_be_the_target_are_not_candidates(pod: PodInfo) -> None:
    with pytest.raises(NoMatchingPodError, match="no Pending pod on node gpu-node-1"):
        pick([pod], 50, (0,))


def test_a_deleted_pod_is_not_matched() -> None:
    doomed = make_pod("doomed", container("c", 50, 1024), created="2026-11-22T08:00:00Z")
    survivor = make_pod("survivor", container("c", 50, 1024))
    deleting = PodInfo(**{**doomed.__dict__, "deleting": True})
    assert pick([deleting, survivor], 50, (0,)) == "survivor/c"
    assert pick([survivor], 50, (0,)) == "survivor/c"  # gone from the cache altogether


def test_steer_follows_the_best_candidate_only_when_it_is_predicated() -> None:
    placed = make_pod("placed", container("c", 50, 1024), annotations=predicated("1", 1000))
    plain = make_pod("plain", container("c", 50, 1024))
    ledger = Ledger(make_gpus(2))
    assert steer(candidates([plain, placed], NODE, ledger, 50)[0]) == (1,)
    assert steer(candidates([plain], NODE, ledger, 50)[0]) is None
    assert steer(None) is None
