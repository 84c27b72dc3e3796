"""The extender's bind over real HTTP against the fake API server: annotations and Binding,
GPU policy and NVLink choice, 50 concurrent binds racing for one GPU, failed binds that
release their reservation, and a restart that rebuilds the book from the pods' annotations."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.domain.annotations import (
    GPU_ASSIGNED,
    PREDICATE_NODE,
    PREDICATE_TIME,
    predicate_key,
)
from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from agent.platform.kube.client import api_client
from agent.platform.kube.podbinding import PodBindingClient
from agent.platform.kube.pods import PodInfo
from tests.integration.extenderkit import (
    Extender,
    args_names,
    bind_body,
    gpu_pod,
    inventory_text,
    post,
    running_extender,
)
from tests.integration.kubeapi import apiserver, wait_until

__all__ = ["apiserver"]
ONE = "gpu-one"  # a node with a single GPU
IDX0 = predicate_key(0, False)


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path) -> Path:
    apiserver.create_node(ONE, annotations={INVENTORY_ANNOTATION: inventory_text(ONE, 1)})
    apiserver.create_node(
        "gpu-four", annotations={INVENTORY_ANNOTATION: inventory_text("gpu-four", 4, nvlink=[(1, 3)])}
    )
    return apiserver.write_kubeconfig(tmp_path / "kc")


@pytest.fixture
def extender(apiserver: FakeApiServer, kubeconfig: Path) -> Iterator[Extender]:
    with running_extender(apiserver, kubeconfig) as ext:
        yield ext


def create(
    apiserver: FakeApiServer, name: str, cores: int | None, memory: int | None = None, **kw: Any
) -> dict[str, Any]:
    return apiserver.create_pod(gpu_pod(name, cores, memory, **kw))


def bind(url: str, pod: dict[str, Any], node: str) -> str:
    status, result = post(url, "bind", bind_body(pod, node))
    assert status == 200, result
    return str(result.get("error") or "")


def pod_annotations(apiserver: FakeApiServer, pod: dict[str, Any]) -> dict[str, str]:
    current = apiserver.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert current is not None
    return dict(current["metadata"].get("annotations") or {})


def node_of(apiserver: FakeApiServer, pod: dict[str, Any]) -> str:
    current = apiserver.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert current is not None
    return str(current["spec"].get("nodeName") or "")


def used_cores(ext: Extender, node: str) -> int:
    return sum(u.cores_used for u in ext.view.gpu_usage(node))


def test_bind_annotates_then_binds(apiserver: FakeApiServer, extender: Extender) -> None:
    pod = create(apiserver, "share", 50, 2048)
    assert bind(extender.url, pod, ONE) == ""
    notes = pod_annotations(apiserver, pod)
    assert notes[IDX0] == "0" and notes[PREDICATE_NODE] == ONE and notes[GPU_ASSIGNED] == "false"
    assert notes[PREDICATE_TIME].isdigit() and len(notes[PREDICATE_TIME]) >= 19  # UnixNano
    assert node_of(apiserver, pod) == ONE
    patch = next(r for r in apiserver.request_log if r.method == "PATCH")
    binding = next(r for r in apiserver.request_log if r.path.endswith("/binding"))
    assert apiserver.request_log.index(patch) < apiserver.request_log.index(binding)
    # The watch shows the bound pod: the reservation becomes a charge from the annotations.
    wait_until(lambda: not extender.view.reservations(), what="reservation confirmed by the watch")
    charge = extender.view.charge_of(pod["metadata"]["uid"])
    assert charge is not None and charge.node == ONE and dict(charge.gpus) == {(False, 0): (0,)}
    assert used_cores(extender, ONE) == 50


def test_pod_without_vcuda_resources_is_bound_without_annotations(
    apiserver: FakeApiServer, extender: Extender
) -> None:
    pod = create(apiserver, "web", None)
    assert bind(extender.url, pod, ONE) == ""
    assert node_of(apiserver, pod) == ONE
    assert not any(k.startswith("nvidia.com/") for k in pod_annotations(apiserver, pod))


@pytest.mark.parametrize(("policy", "gpu"), [("binpack", "0"), ("spread", "1")])
def test_gpu_policy_chooses_the_gpu(
    apiserver: FakeApiServer, extender: Extender, policy: str, gpu: str
) -> None:
    placed = {IDX0: "0", PREDICATE_NODE: "gpu-four"}
    create(apiserver, "running", 50, 1024, node="gpu-four", annotations=placed)
    wait_until(lambda: used_cores(extender, "gpu-four") == 50)
    pod = create(apiserver, "new", 20, 1024, annotations={"nvidia.com/vcuda-gpu-policy": policy})
    assert bind(extender.url, pod, "gpu-four") == ""
    chosen = pod_annotations(apiserver, pod)[IDX0]
    if policy == "binpack":
        assert chosen == gpu
    else:
        assert chosen != "0"  # any empty GPU


def test_whole_gpus_prefer_the_nvlink_pair(apiserver: FakeApiServer, extender: Extender) -> None:
    pod = create(apiserver, "pair", 200)
    assert bind(extender.url, pod, "gpu-four") == ""
    assert pod_annotations(apiserver, pod)[IDX0] == "1,3"


def test_fifty_concurrent_binds_never_oversubscribe_one_gpu(
    apiserver: FakeApiServer, extender: Extender
) -> None:
    pods = [create(apiserver, f"racer-{i}", 30, 1024) for i in range(50)]
    wait_until(lambda: len(apiserver.pods()) == 50)
    errors: dict[str, str] = {}
    start = threading.Barrier(50)

    def race(pod: dict[str, Any]) -> None:
        start.wait()
        errors[pod["metadata"]["name"]] = bind(extender.url, pod, ONE)

    threads = [threading.Thread(target=race, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(errors) == 50
    succeeded = [name for name, error in errors.items() if not error]
    assert len(succeeded) == 3, errors  # 3 x 30 cores fit one GPU, a 4th would need 120
    assert all("fit" in e for e in errors.values() if e), errors
    bound = [p for p in apiserver.pods() if p["spec"].get("nodeName") == ONE]
    assert sorted(p["metadata"]["name"] for p in bound) == sorted(succeeded)
    cores = [int(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/vcuda-core"]) for p in bound]
    assert all(p["metadata"]["annotations"][IDX0] == "0" for p in bound)
    assert sum(cores) <= 100
    losers = [p for p in apiserver.pods() if p["metadata"]["name"] not in succeeded]
    assert not any(IDX0 in (p["metadata"].get("annotations") or {}) for p in losers)
    wait_until(lambda: not extender.view.reservations())
    assert used_cores(extender, ONE) == 90


class _BoundMeanwhile(PodBindingClient):
    """Another scheduler binds the pod right after our patch: the Binding gets a 409."""

    def __init__(self, apiserver: FakeApiServer, kubeconfig: Path) -> None:
        super().__init__(api_client(kubeconfig, in_cluster=False))
        self._apiserver = apiserver
        self.raced = False

    def patch_annotations(self, namespace: str, name: str, *args: Any, **kwargs: Any) -> PodInfo:
        pod = super().patch_annotations(namespace, name, *args, **kwargs)
        if not self.raced:
            self.raced = True
            self._apiserver.patch_pod(namespace, name, {"spec": {"nodeName": "other-node"}})
        return pod


def test_a_failed_binding_releases_and_removes_the_annotations(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    with running_extender(apiserver, kubeconfig, pods=_BoundMeanwhile(apiserver, kubeconfig)) as ext:
        pod = create(apiserver, "taken", 100)
        error = bind(ext.url, pod, ONE)
        assert "cannot bind" in error and "409" in error, error
        assert not ext.view.reservations()
        wait_until(lambda: IDX0 not in pod_annotations(apiserver, pod), what="annotations removed")
        assert node_of(apiserver, pod) == "other-node"
        wait_until(lambda: used_cores(ext, ONE) == 0)
        full = create(apiserver, "full", 100)
        assert bind(ext.url, full, ONE) == ""  # the GPU was released


def test_a_pod_bound_already_is_refused_or_acknowledged(apiserver: FakeApiServer, extender: Extender) -> None:
    elsewhere = create(apiserver, "elsewhere", 50, 1024, node="other-node")
    assert "bound to node other-node already" in bind(extender.url, elsewhere, ONE)
    assert not any(k.startswith("nvidia.com/predicate") for k in pod_annotations(apiserver, elsewhere))
    pod = create(apiserver, "retried", 50, 1024)
    assert bind(extender.url, pod, ONE) == ""
    assert bind(extender.url, pod, ONE) == ""  # kube-scheduler retried after a timeout: same answer
    assert node_of(apiserver, pod) == ONE


class _RacingClient(PodBindingClient):
    """Someone changes the pod between our read and our patch: the patch must get a 409."""

    def __init__(self, apiserver: FakeApiServer, kubeconfig: Path) -> None:
        super().__init__(api_client(kubeconfig, in_cluster=False))
        self._apiserver = apiserver

    def get(self, namespace: str, name: str) -> PodInfo:
        pod = super().get(namespace, name)
        self._apiserver.patch_pod(namespace, name, {"metadata": {"labels": {"touched": "yes"}}})
        return pod


def test_a_lost_patch_race_releases(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    with running_extender(apiserver, kubeconfig, pods=_RacingClient(apiserver, kubeconfig)) as ext:
        pod = create(apiserver, "raced", 100)
        error = bind(ext.url, pod, ONE)
        assert "409" in error and "annotate" in error, error
        assert not ext.view.reservations() and ext.view.charge_of(pod["metadata"]["uid"]) is None
        assert node_of(apiserver, pod) == "" and IDX0 not in pod_annotations(apiserver, pod)
    with running_extender(apiserver, kubeconfig) as ext:
        assert bind(ext.url, pod, ONE) == ""


def test_an_unreachable_api_fails_the_bind_and_reserves_nothing(
    apiserver: FakeApiServer, extender: Extender
) -> None:
    pod = create(apiserver, "unlucky", 100)
    apiserver.fail_next(1, 500)
    assert "500" in bind(extender.url, pod, ONE)
    assert not extender.view.reservations() and used_cores(extender, ONE) == 0
    assert bind(extender.url, pod, ONE) == ""


def test_a_recreated_pod_is_not_bound(apiserver: FakeApiServer, extender: Extender) -> None:
    pod = create(apiserver, "again", 50, 1024)
    stale = json.loads(bind_body(pod, ONE))
    stale["podUID"] = "00000000-0000-0000-0000-000000000000"
    status, result = post(extender.url, "bind", json.dumps(stale).encode())
    assert status == 200 and "re-created" in result["error"]
    assert node_of(apiserver, pod) == ""


def test_restart_rebuilds_the_book_from_annotations(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    with running_extender(apiserver, kubeconfig) as first:
        for i in range(2):
            assert bind(first.url, create(apiserver, f"p{i}", 30, 1024), ONE) == ""
    # Placed by the node agent (another scheduler bound it; Allocate wrote the annotations).
    agent_placed = {IDX0: "0", PREDICATE_NODE: ONE, GPU_ASSIGNED: "true"}
    create(apiserver, "by-agent", 30, 1024, node=ONE, annotations=agent_placed)
    with running_extender(apiserver, kubeconfig) as second:
        assert used_cores(second, ONE) == 90
        probe30 = gpu_pod("probe", 30, 1024)
        probe30["metadata"]["uid"] = "probe-uid"
        _, result = post(second.url, "filter", args_names(probe30, [ONE]))
        assert result["nodenames"] == [] and result["failedNodes"][ONE]
        probe10 = gpu_pod("probe", 10, 1024)
        probe10["metadata"]["uid"] = "probe-uid"
        assert post(second.url, "filter", args_names(probe10, [ONE]))[1]["nodenames"] == [ONE]
        late = create(apiserver, "late", 30, 1024)
        assert "fit" in bind(second.url, late, ONE)


def test_init_containers_get_their_own_annotation(apiserver: FakeApiServer, extender: Extender) -> None:
    manifest = gpu_pod("with-init", 50, 1024)
    init = json.loads(json.dumps(manifest["spec"]["containers"][0]))
    init["name"] = "prepare"
    init["resources"] = {"limits": {"nvidia.com/vcuda-core": "100"}}
    manifest["spec"]["initContainers"] = [init]
    pod = apiserver.create_pod(manifest)
    assert bind(extender.url, pod, "gpu-four") == ""
    notes = pod_annotations(apiserver, pod)
    assert notes[predicate_key(0, True)].isdigit() and notes[IDX0].isdigit()


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"phase": "Failed"}, "is Failed, not Pending"),
        ({"metadata": {"deletionTimestamp": "2026-11-26T00:00:00Z"}}, "is being deleted"),
        ({"spec": {"schedulerName": "tenant-scheduler"}}, "scheduled by 'tenant-scheduler'"),
    ],
)
def test_bind_re_checks_the_pod_before_it_binds(
    apiserver: FakeApiServer, extender: Extender, change: dict[str, Any], refusal: str
) -> None:
    """A forged /bind (the extender binds with its own rights) for a pod kube-scheduler would
    never send: refused, nothing reserved, annotated or bound."""
    pod = create(apiserver, "forged", 50, 1024)
    if "phase" in change:
        apiserver.set_pod_phase("default", "forged", change["phase"])
    else:
        apiserver.patch_pod("default", "forged", change)
    assert refusal in bind(extender.url, pod, ONE)
    assert node_of(apiserver, pod) == "" and IDX0 not in pod_annotations(apiserver, pod)
    assert not extender.view.reservations() and used_cores(extender, ONE) == 0


def test_bind_refuses_a_pod_that_does_not_fit(apiserver: FakeApiServer, extender: Extender) -> None:
    first = create(apiserver, "first", 80, 1024)
    assert bind(extender.url, first, ONE) == ""
    second = create(apiserver, "second", 40, 1024)
    assert "no longer fits node" in bind(extender.url, second, ONE)
    assert node_of(apiserver, second) == "" and used_cores(extender, ONE) == 80


def test_bind_serves_the_schedulers_it_is_told(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    with running_extender(apiserver, kubeconfig, scheduler_names=("gpu-scheduler",)) as ext:
        default = create(apiserver, "default", 10, 512)
        assert "scheduled by 'vcuda-scheduler'" in bind(ext.url, default, ONE)  # the fixture's
        manifest = gpu_pod("ours", 10, 512)
        manifest["spec"]["schedulerName"] = "gpu-scheduler"
        ours = apiserver.create_pod(manifest)
        assert bind(ext.url, ours, ONE) == ""
        assert node_of(apiserver, ours) == ONE


def test_forged_predicate_annotations_on_unbound_pods_hold_no_gpu(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """A tenant's own Pending pods, annotated as if our bind had placed them
    on the node's only GPU, used to make every other pod's filter fail ("0 cores free")."""
    forged = {IDX0: "0", PREDICATE_NODE: ONE, PREDICATE_TIME: "1", GPU_ASSIGNED: "false"}
    for name, cores in (("squat-a", 60), ("squat-b", 40)):
        create(apiserver, name, cores, 1024, annotations=forged)
    probe = gpu_pod("probe", 50, 1024)
    probe["metadata"]["uid"] = "probe-uid"
    for round_ in range(2):  # the live watch, then a restarted extender's first LIST
        with running_extender(apiserver, kubeconfig) as ext:
            # A pod created after the forged ones: once the (ordered) watch shows it, it showed them.
            marker = create(apiserver, f"marker-{round_}", 10, 1024, node="gpu-four")
            wait_until(lambda: ext.view.charge_of(marker["metadata"]["uid"]) is not None)  # noqa: B023
            assert used_cores(ext, ONE) == 0
            status, result = post(ext.url, "filter", args_names(probe, [ONE]))
            assert status == 200 and result["nodenames"] == [ONE], result
    with running_extender(apiserver, kubeconfig) as ext:
        # What our own bind places does count, and the forged pod is still bindable.
        squat = apiserver.pod("default", "squat-a")
        assert squat is not None and bind(ext.url, squat, ONE) == ""
        assert pod_annotations(apiserver, squat)[PREDICATE_TIME] != "1"  # bind wrote its own
        wait_until(lambda: used_cores(ext, ONE) == 60 and ext.view.reservations() == {})
        _, result = post(ext.url, "filter", args_names(probe, [ONE]))
        assert result["nodenames"] == [] and "GPU 0" in result["failedNodes"][ONE]
