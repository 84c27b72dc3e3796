"""A pod refused at Allocate is still Pending in the agent's pod cache for a moment (kubelet
marks it Failed later), and the next pod asking the same vcuda-core may not be in the cache
yet either: its Allocate waits for it rather than being matched to the refused pod again.

Found in a fresh-clone CI run: the integration test of this
(``test_a_refused_pod_is_not_taken_for_the_next_pod_of_the_same_size``) failed once when
kubelet's Allocate for the second pod came before the agent's watch had shown it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent.control.allocations import Allocations
from agent.control.annotator import Annotator
from agent.domain.ledger import Ledger
from agent.domain.requests import ResolvedRequest
from agent.errors import AllocationError
from agent.platform.kube.pods import PodInfo
from tests.fuzz.node import GPUS, IDS, PLACER, TABLE, Nowhere, PodCache
from tests.unit.kubefixtures import NODE, container, make_pod


class LaggingPods(PodCache):
    """A pod source whose watch is behind: ``late`` pods show up only once the agent waits
    for the cache (as a real watch catches up while Allocate waits)."""

    def __init__(self, pods: list[PodInfo], late: list[PodInfo]) -> None:
        super().__init__(list(pods))
        self._late = list(late)
        self._version = 1
        self.waits = 0

    def snapshot(self) -> tuple[int, list[PodInfo]]:
        return self._version, self.pods()

    def version(self) -> int:
        return self._version

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        self.waits += 1
        if self._late:
            self._pods += self._late
            self._late.clear()
            self._version += 1
        return predicate()


def allocations_over(pods: LaggingPods, *, wait_for_pod_s: float) -> Allocations:
    return Allocations(
        node_name=NODE,
        table=TABLE,
        placer=PLACER,
        ledger=Ledger(GPUS),
        pods=pods,
        annotator=Annotator(Nowhere()),
        events=Nowhere(),
        wait_for_pod_s=wait_for_pod_s,
    )


def test_the_next_pod_of_a_refused_ones_size_waits_for_the_cache_and_gets_the_ids() -> None:
    greedy = make_pod("a-greedy", container("cuda", 30, 90 * 1024))  # more memory than a GPU has
    fits = make_pod("b-fits", container("cuda", 30, 10 * 1024), created="2026-11-22T10:00:01Z")
    pods = LaggingPods([greedy], late=[fits])
    allocations = allocations_over(pods, wait_for_pod_s=3.0)
    request = ResolvedRequest(30, (GPUS[0],))
    with pytest.raises(AllocationError, match="a-greedy"):
        allocations.allocate(IDS[0][:30], request)
    # b-fits asks next, before the cache shows it: only the refused pod is there.
    item = allocations.allocate(IDS[0][30:60], request)
    assert (item.pod, item.memory_mib) == ("b-fits", 10 * 1024)
    assert pods.waits >= 1


def test_a_refused_pod_alone_is_still_matched_after_the_wait() -> None:
    """Nobody else shows up: after ``wait_for_pod_s`` the refused pod is the one asking (its
    refusal is given again, with why), not a request without a pod."""
    greedy = make_pod("a-greedy", container("cuda", 30, 90 * 1024))
    pods = LaggingPods([greedy], late=[])
    allocations = allocations_over(pods, wait_for_pod_s=0.0)
    request = ResolvedRequest(30, (GPUS[0],))
    for _ in range(2):
        with pytest.raises(AllocationError, match="a-greedy/cuda needs 30 vcuda-core"):
            allocations.allocate(IDS[0][:30], request)
    assert pods.waits == 1  # the first Allocate found a fresh candidate; the second waited
