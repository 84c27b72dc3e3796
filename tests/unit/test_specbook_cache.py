"""SpecBook rebuilds specs only when the ledger, a pod of it or the node labels changed."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from agent.control.specbook import SpecBook
from agent.domain.annotations import CORE_LIMIT, Policy
from agent.domain.ledger import Assignment, Ledger
from agent.domain.specs import SpecBounds
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import container, make_gpus, make_pod

ANY_LIMIT = SpecBounds(frozenset(Policy), 100.0)  # this test is about the cache, not the bounds


class Pods:
    """The part of the pod cache SpecBook reads."""

    def __init__(self) -> None:
        self.by_uid: dict[str, PodInfo] = {}
        self.gets = 0

    def get(self, uid: str) -> PodInfo | None:
        self.gets += 1
        return self.by_uid.get(uid)

    def pods(self) -> list[PodInfo]:
        return list(self.by_uid.values())

    def snapshot(self) -> tuple[int, list[PodInfo]]:
        return self.version(), self.pods()

    def version(self) -> int:
        """Changes whenever the test puts another pod in (PodInfo objects are replaced)."""
        return hash(tuple((uid, id(pod)) for uid, pod in self.by_uid.items()))

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


def one_pod_book(labels: Callable[[], Mapping[str, str]]) -> tuple[SpecBook, Pods, Ledger, PodInfo]:
    """A book over a ledger with one pod's container (30 cores, 1 GiB) on GPU 0."""
    ledger = Ledger(make_gpus(1))
    pods = Pods()
    book = SpecBook(ledger, pods, Events(), "n", labels, bounds=lambda: ANY_LIMIT)
    pod = make_pod("a", container("c", 30, 1024))
    pods.by_uid[pod.uid] = pod
    ledger.assign(Assignment(pod.uid, "default", "a", "c", False, (0,), 30, 1024))
    return book, pods, ledger, pod


def test_specs_follow_ledger_pod_and_label_changes_and_are_reused_otherwise() -> None:
    labels: dict[str, str] = {}
    book, pods, ledger, pod = one_pod_book(lambda: labels)
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


def test_a_pod_asking_beyond_the_bounds_gets_them_and_one_event_and_a_wider_config_applies() -> None:
    ledger = Ledger(make_gpus(1))
    pods = Pods()
    events = Events()
    bounds = SpecBounds()  # the defaults: fixed-share and burst-share, caps at the request
    book = SpecBook(ledger, pods, events, "n", bounds=lambda: bounds)
    pod = make_pod("a", container("c", 10, 1024), annotations={CORE_LIMIT: "100"})
    pods.by_uid[pod.uid] = pod
    ledger.assign(Assignment(pod.uid, "default", "a", "c", False, (0,), 10, 1024))
    assert [s.cap for s in book.specs()] == [10]
    book.check_pod(pod)  # Allocate and pod updates report too: still one Event
    assert events.seen == ["GPUAnnotationBounded"]
    bounds = SpecBounds(max_limit_ratio=3)  # the admin widened the node config
    assert [s.cap for s in book.specs()] == [30]
    spec = book.spec_for(ledger.assignments()[0])  # what Allocate hands MPS clients, bounded too
    assert spec.cap == 30


def test_pods_are_compared_only_when_the_pod_cache_moved_and_an_unrelated_change_rebuilds_nothing() -> None:
    labels: dict[str, str] = {}
    book, pods, _, _ = one_pod_book(lambda: labels)
    first = book.specs()
    pods.gets = 0
    assert book.specs()[0] is first[0] and pods.gets == 0  # the cache's version did not move
    other = make_pod("b", container("c", 10, 1024))
    pods.by_uid[other.uid] = other  # another pod of the node: the version moves
    assert book.specs()[0] is first[0] and pods.gets == 1  # ours compared, nothing rebuilt
    pods.gets = 0
    assert book.specs()[0] is first[0] and pods.gets == 0
