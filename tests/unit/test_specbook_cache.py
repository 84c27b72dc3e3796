"""SpecBook rebuilds specs only when the ledger, a pod of it or the node labels changed."""

from __future__ import annotations

from collections.abc import Callable

from agent.control.specbook import SpecBook
from agent.domain.annotations import CORE_LIMIT
from agent.domain.ledger import Assignment, Ledger
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import container, make_gpus, make_pod


class Pods:
    """The part of the pod cache SpecBook reads."""

    def __init__(self) -> None:
        self.by_uid: dict[str, PodInfo] = {}

    def get(self, uid: str) -> PodInfo | None:
        return self.by_uid.get(uid)

    def pods(self) -> list[PodInfo]:
        return list(self.by_uid.values())

    def snapshot(self) -> tuple[int, list[PodInfo]]:
        return 0, self.pods()

    def find(self, namespace: str, name: str) -> PodInfo | None:
        return None

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        return predicate()


class Events:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        self.seen.append(reason)

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        self.seen.append(reason)


def test_specs_follow_ledger_pod_and_label_changes_and_are_reused_otherwise() -> None:
    labels: dict[str, str] = {}
    ledger = Ledger(make_gpus(1))
    pods = Pods()
    book = SpecBook(ledger, pods, Events(), "n", lambda: labels)
    pod = make_pod("a", container("c", 30, 1024))
    pods.by_uid[pod.uid] = pod
    ledger.assign(Assignment(pod.uid, "default", "a", "c", False, (0,), 30, 1024))
    first = book.specs()
    assert [s.cap for s in first] == [30]
    assert book.specs()[0] is first[0]  # nothing changed: the same spec objects
    limited = make_pod("a", container("c", 30, 1024), annotations={CORE_LIMIT: "60"})
    pods.by_uid[pod.uid] = limited  # a new PodInfo (annotation edited)
    assert [s.cap for s in book.specs()] == [60]
    labels = {"nvidia.com/vcuda-policy": "burst-share"}  # a new labels object
    assert [str(s.policy) for s in book.specs()] == ["burst-share"]
    ledger.release(pod.uid)
    assert book.specs() == []
