"""PodCache (list+watch through the real kubernetes client) against the fake API server over HTTP."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from agent.emulators.apiserver import FakeApiServer
from agent.platform.kube.client import api_client
from agent.platform.kube.podcache import PodCache
from agent.platform.kube.pods import PodInfo
from tests.integration.kubeapi import (
    NODE,
    apiserver,
    kube,
    lists,
    pod_manifest,
    running,
    wait_until,
    watches,
)

__all__ = ["apiserver", "kube"]  # fixtures

Seen = list[tuple[str, str | None, str | None]]  # (type, old name, new name)


def make_cache(kube: ApiClient) -> PodCache:
    return PodCache(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)


@pytest.fixture
def cache(kube: ApiClient) -> PodCache:
    return make_cache(kube)


@pytest.fixture
def seen(cache: PodCache) -> Seen:
    events: Seen = []

    def record(kind: str, old: PodInfo | None, new: PodInfo | None) -> None:
        events.append((kind, old.name if old else None, new.name if new else None))

    cache.subscribe(record)
    return events


@pytest.fixture
def synced(cache: PodCache) -> Iterator[PodCache]:
    with running(cache.run, "pod-cache"):
        assert cache.wait_synced(10)
        yield cache


def phase_of(cache: PodCache, uid: str, phase: str) -> PodInfo | None:
    pod = cache.get(uid)
    return pod if pod is not None and pod.phase == phase else None


def names(cache: PodCache) -> set[str]:
    return {p.name for p in cache.pods()}


def test_initial_list_holds_only_this_nodes_pods(
    apiserver: FakeApiServer, cache: PodCache, seen: Seen
) -> None:
    apiserver.create_pod(pod_manifest("mine-1"))
    apiserver.create_pod(pod_manifest("mine-2", namespace="team"))
    apiserver.create_pod(pod_manifest("other", node="gpu-node-2"))
    apiserver.create_pod(pod_manifest("unscheduled", node=None))
    assert not cache.stats().synced
    with running(cache.run, "pod-cache"):
        assert cache.wait_synced(10)
        assert names(cache) == {"mine-1", "mine-2"}
        team = cache.find("team", "mine-2")
        assert team is not None and cache.get(team.uid) == team
        assert team.containers[0].quantity("nvidia.com/vcuda-core") == 50
        assert sorted(seen) == [("ADDED", None, "mine-1"), ("ADDED", None, "mine-2")]
        stats = cache.stats()
        assert stats.synced and stats.pods == 2 and stats.lists == 1
        assert stats.staleness_s is not None and stats.staleness_s < 5
    assert lists(apiserver.request_log)[0].query["fieldSelector"] == f"spec.nodeName={NODE}"


def test_add_modify_delete_and_binding_reach_the_cache(
    apiserver: FakeApiServer, synced: PodCache, seen: Seen
) -> None:
    created = apiserver.create_pod(pod_manifest("p"))
    pod = wait_until(lambda: synced.find("default", "p"), what="pod added")
    assert pod.uid == created["metadata"]["uid"] and pod.phase == "Pending"
    added = synced.version()
    assert added == synced.snapshot()[0]

    apiserver.set_pod_phase("default", "p", "Running", {"main": "abc123"})
    running_pod = wait_until(lambda: phase_of(synced, pod.uid, "Running"), what="phase Running")
    assert synced.version() > added  # what a view kept of the pods (SpecBook) is rebuilt on
    assert running_pod.containers[0].container_id == "abc123"
    assert running_pod.containers[0].runtime == "containerd"

    # A pod bound to this node later (scheduler binding) enters the selector: ADDED for us.
    apiserver.create_pod(pod_manifest("late", node=None))
    apiserver.store.update(
        "pods", "default", "late", lambda p: {**p, "spec": {**p["spec"], "nodeName": NODE}}
    )
    wait_until(lambda: synced.find("default", "late"), what="bound pod added")

    apiserver.delete_pod("default", "p")
    wait_until(lambda: synced.get(pod.uid) is None, what="pod deleted")
    assert ("MODIFIED", "p", "p") in seen
    assert seen[-1] == ("DELETED", "p", None)
    assert ("ADDED", None, "late") in seen
    assert synced.stats().relists == 0


def test_410_after_compaction_relists_and_delivers_missed_deletes(
    apiserver: FakeApiServer, synced: PodCache, seen: Seen
) -> None:
    for name in ("keep", "gone"):
        apiserver.create_pod(pod_manifest(name))
    wait_until(lambda: names(synced) == {"keep", "gone"})
    gone = synced.find("default", "gone")
    assert gone is not None
    lists_before = len(lists(apiserver.request_log))

    apiserver.compact()
    apiserver.delete_pod("default", "gone")  # the watch gets 410 instead of this DELETED
    apiserver.create_pod(pod_manifest("new"))

    wait_until(lambda: names(synced) == {"keep", "new"}, what="cache rebuilt by a re-list")
    stats = synced.stats()
    assert stats.relists == 1
    assert len(lists(apiserver.request_log)) == lists_before + 1
    assert ("DELETED", "gone", None) in seen  # synthesized from the re-list
    assert synced.get(gone.uid) is None
    # And the watch works again after the re-list.
    apiserver.create_pod(pod_manifest("after"))
    wait_until(lambda: "after" in names(synced))


def test_dropped_watch_resumes_from_last_rv_without_relist(
    apiserver: FakeApiServer, synced: PodCache
) -> None:
    apiserver.create_pod(pod_manifest("a"))
    wait_until(lambda: "a" in names(synced))
    wait_until(lambda: apiserver.open_watches("pods") == 1)
    apiserver.clear_request_log()

    apiserver.drop_watches()
    apiserver.create_pod(pod_manifest("b"))  # written while no watch is open
    wait_until(lambda: "b" in names(synced), what="pod created during the drop")

    log = apiserver.request_log
    assert lists(log) == []
    rewatch = watches(log)[0]
    assert int(rewatch.query["resourceVersion"]) >= int(
        (apiserver.pod("default", "a") or {})["metadata"]["resourceVersion"]
    )
    assert int(rewatch.query["resourceVersion"]) < int(
        (apiserver.pod("default", "b") or {})["metadata"]["resourceVersion"]
    )
    assert synced.stats().watch_restarts >= 1 and synced.stats().relists == 0


def test_bookmarks_advance_the_resource_version(apiserver: FakeApiServer, synced: PodCache) -> None:
    wait_until(lambda: apiserver.open_watches("pods") == 1)
    for i in range(3):  # changes the watch does not see (another node): only bookmarks tell
        apiserver.create_pod(pod_manifest(f"elsewhere-{i}", node="gpu-node-2"))
    current = apiserver.resource_version
    wait_until(
        lambda: int(synced._reflector.stats.resource_version) >= current, what="a bookmark with the new rv"
    )
    assert synced._reflector.stats.bookmarks >= 1
    apiserver.clear_request_log()
    apiserver.drop_watches()
    rewatch = wait_until(lambda: watches(apiserver.request_log), what="re-watch")[0]
    assert int(rewatch.query["resourceVersion"]) >= current
    assert rewatch.query["allowWatchBookmarks"] == "true"


def test_api_errors_back_off_then_recover(apiserver: FakeApiServer, synced: PodCache) -> None:
    wait_until(lambda: apiserver.open_watches("pods") == 1)
    apiserver.clear_request_log()
    apiserver.fail_next(3, 500)
    apiserver.drop_watches()
    apiserver.create_pod(pod_manifest("x"))
    wait_until(lambda: "x" in names(synced), what="recovery after 3 failed requests")
    statuses = [r.status for r in watches(apiserver.request_log)]
    assert statuses[:3] == [500, 500, 500] and 200 in statuses[3:]
    assert synced.stats().errors >= 3


def test_errors_before_the_first_list_are_retried(apiserver: FakeApiServer, cache: PodCache) -> None:
    apiserver.create_pod(pod_manifest("p"))
    apiserver.fail_next(2, 503)
    with running(cache.run, "pod-cache"):
        assert cache.wait_synced(10)
        assert names(cache) == {"p"}
        assert cache.stats().errors == 2


def test_unparsable_pod_is_skipped_and_logged_once(
    apiserver: FakeApiServer, synced: PodCache, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "agent.platform.kube.podcache")
    apiserver.create_pod(pod_manifest("bad"))
    wait_until(lambda: "bad" in names(synced))
    # Garbage the server accepts but the parser cannot use: resources that are not a map.
    apiserver.patch_pod("default", "bad", {"spec": {"containers": [{"name": "main", "resources": "lots"}]}})
    apiserver.patch_pod("default", "bad", {"metadata": {"labels": {"again": "1"}}})
    apiserver.create_pod(pod_manifest("good"))
    wait_until(lambda: "good" in names(synced), what="the cache keeps going")
    skips = [r for r in caplog.records if "skipping pod default/bad" in r.getMessage()]
    assert len(skips) == 1
    assert synced.stats().skipped == 1
    bad = synced.find("default", "bad")
    assert bad is not None and bad.containers[0].resources  # the last good version is kept


def test_apply_local_writes_through_and_ignores_stale(
    apiserver: FakeApiServer, synced: PodCache, seen: Seen
) -> None:
    apiserver.create_pod(pod_manifest("p"))
    pod = wait_until(lambda: synced.find("default", "p"))
    newer = PodInfo(
        **{**pod.__dict__, "annotations": {"x": "1"}, "resource_version": str(int(pod.resource_version) + 50)}
    )
    synced.apply_local(newer)
    assert synced.get(pod.uid) == newer and seen[-1] == ("MODIFIED", "p", "p")
    synced.apply_local(pod)  # older: ignored
    assert synced.get(pod.uid) == newer

    apiserver.delete_pod("default", "p")
    wait_until(lambda: synced.get(pod.uid) is None)
    late = PodInfo(**{**pod.__dict__, "resource_version": str(int(pod.resource_version) + 99)})
    synced.apply_local(late)  # a PATCH result that arrives after the DELETED must not resurrect it
    assert synced.get(pod.uid) is None


def test_wait_for_wakes_on_change(apiserver: FakeApiServer, synced: PodCache) -> None:
    threading.Timer(0.2, lambda: apiserver.create_pod(pod_manifest("soon"))).start()
    started = time.monotonic()
    assert synced.wait_for(lambda: synced.find("default", "soon") is not None, timeout_s=10)
    assert time.monotonic() - started < 5
    assert not synced.wait_for(lambda: False, timeout_s=0.1)


def test_stop_ends_an_open_watch_promptly(apiserver: FakeApiServer, cache: PodCache) -> None:
    with running(cache.run, "pod-cache") as stop:
        assert cache.wait_synced(10)
        wait_until(lambda: apiserver.open_watches("pods") == 1)
        started = time.monotonic()
        stop.set()
    assert time.monotonic() - started < 2
    wait_until(lambda: apiserver.open_watches("pods") == 0, what="the server saw the watch close")


def test_a_thousand_pods(apiserver: FakeApiServer, kube: ApiClient) -> None:
    for i in range(1000):
        apiserver.create_pod(pod_manifest(f"pod-{i:04d}"))
    cache = make_cache(kube)
    with running(cache.run, "pod-cache"):
        started = time.monotonic()
        assert cache.wait_synced(30)
        load_s = time.monotonic() - started
        assert len(cache.pods()) == 1000
        started = time.perf_counter()
        for _ in range(100):
            cache.pods()
        snapshot_ms = (time.perf_counter() - started) * 10
    assert load_s < 10, f"listing 1000 pods took {load_s:.1f} s"
    assert snapshot_ms < 2, f"a snapshot of 1000 pods took {snapshot_ms:.2f} ms"


def test_api_server_restart(apiserver: FakeApiServer, synced: PodCache) -> None:
    apiserver.create_pod(pod_manifest("before"))
    wait_until(lambda: "before" in names(synced))
    apiserver.stop()
    wait_until(lambda: synced.stats().errors >= 1, what="the cache noticing the outage")
    assert names(synced) == {"before"}  # the last known state is still served
    apiserver.start()  # same port, same objects
    apiserver.create_pod(pod_manifest("after"))
    wait_until(lambda: names(synced) == {"before", "after"}, what="catching up after the restart")
    assert synced.stats().relists == 0


def test_watches_that_end_at_once_do_not_spin(tmp_path: Path) -> None:
    with FakeApiServer(max_watch_s=0) as server:  # every watch stream ends as soon as it starts
        client = api_client(server.write_kubeconfig(tmp_path / "kc"), in_cluster=False)
        cache = PodCache(client, NODE, min_backoff_s=0.1, max_backoff_s=0.4)
        with running(cache.run, "pod-cache"):
            assert cache.wait_synced(10)
            server.create_pod(pod_manifest("p"))
            wait_until(lambda: "p" in names(cache), what="a change picked up by a re-watch")
            time.sleep(1.5)
        # With back-off (0.1, 0.2, 0.4, 0.4 ...) about six watches; without it, hundreds.
        assert len(watches(server.request_log)) < 15
        assert len(lists(server.request_log)) == 1


def test_a_relist_prunes_written_through_pods_the_api_does_not_have(
    apiserver: FakeApiServer, synced: PodCache, seen: Seen
) -> None:
    rv = str(apiserver.resource_version)
    ghost = PodInfo(uid="ghost-uid", namespace="default", name="ghost", node_name=NODE, resource_version=rv)
    future = PodInfo(
        uid="future-uid", namespace="default", name="future", node_name=NODE, resource_version="999999"
    )
    synced.apply_local(ghost)
    synced.apply_local(future)
    assert synced.get("ghost-uid") == ghost
    wait_until(lambda: apiserver.open_watches("pods") == 1)  # compaction must hit an open watch
    apiserver.compact()
    apiserver.create_pod(pod_manifest("trigger"))  # the watch gets 410: re-list
    wait_until(lambda: synced.get("ghost-uid") is None, what="ghost pruned by the re-list")
    assert ("DELETED", "ghost", None) in seen
    assert synced.get("future-uid") == future  # newer than the list: kept
    assert "trigger" in names(synced)
