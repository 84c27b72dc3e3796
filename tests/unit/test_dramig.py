"""Dynamic MIG around the DRA driver: the node config's ``mig.dynamic``, ShareConfig
``isolation``, the checkpoint of a claim's instances, the device nodes its users get (and the
guard's merge of them), and what the preparer refuses when dynamic MIG is off."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.control.draclaims import PreparedClaims
from agent.control.dramig import DynamicMig, DynamicMigError
from agent.control.dramiggrants import ClaimMig, claim_pods, mig_grants
from agent.control.guardtargets import GuardTargets
from agent.control.migholdings import MigGrant
from agent.domain.dra import (
    ISOLATION_MIG,
    ClaimError,
    ClaimRef,
    PreparedClaim,
    PreparedDevice,
    PreparedMig,
    claim_shares,
)
from agent.domain.ledger import Ledger
from agent.domain.migconfig import MigConfig, parse_mig
from agent.platform.cgroups.devicepolicy import DevicePolicy
from agent.platform.gpu.migprofiles import Placement, product
from agent.platform.gpu.migstate import MigInfo
from agent.platform.kube.pods import pod_from_json
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.preparer import ClaimPreparer
from tests.unit.draobjects import DRIVER_FILES, GPUS, NODE, FakeClaims, Result, allocated_claim, ref_of
from tests.unit.kubefixtures import make_gpus


def test_dynamic_lists_gpu_indexes_apart_from_the_geometry() -> None:
    problems: list[str] = []
    assert parse_mig({"dynamic": [1, 0]}, "node", problems).dynamic == frozenset({0, 1})
    assert problems == []
    for raw, why in (
        ({"dynamic": "0"}, "must be a list of GPU indexes"),
        ({"dynamic": [True]}, "must be a list of GPU indexes"),
        ({"dynamic": [64]}, "must be a list of GPU indexes"),
        ({"dynamic": [0], "geometry": {"0": ["7g.80gb"]}}, "GPU 0 is also in mig.geometry"),
    ):
        problems = []
        assert parse_mig(raw, "node", problems) == MigConfig()
        assert any(why in p for p in problems), problems


H100 = product("H100-80GB")
MIG = PreparedMig("gpu", "gpu-0-mig-3g40gb-4", 0, 0, 2, 0, "MIG-abc", "3g.40gb", 4, 4, (21, 22))


def _claim(isolation: str | None = None, device: str = "gpu-0") -> dict[str, Any]:
    claim = allocated_claim("train", [Result("gpu", 0)])
    claim["status"]["allocation"]["devices"]["results"][0]["device"] = device
    if isolation is not None:
        params = {"apiVersion": "gpu.vcuda.io/v1alpha1", "kind": "ShareConfig", "isolation": isolation}
        claim["status"]["allocation"]["devices"]["config"] = [
            {"source": "FromClaim", "opaque": {"driver": "gpu.vcuda.io", "parameters": params}}
        ]
    return claim


def test_share_config_isolation_is_mig_or_none() -> None:
    [share] = claim_shares(_claim(ISOLATION_MIG), NODE)
    assert share.isolation == ISOLATION_MIG
    [share] = claim_shares(_claim("none"), NODE)
    assert share.isolation is None
    with pytest.raises(ClaimError, match=r"isolation 'hardware': mig or none"):
        claim_shares(_claim("hardware"), NODE)
    [share] = claim_shares(_claim(device="gpu-0-mig-3g40gb-4"), NODE)
    assert (share.gpu_index, share.device) == (0, "gpu-0-mig-3g40gb-4")


def test_a_claims_instances_survive_the_checkpoint(tmp_path: Path) -> None:
    claim = _claim(ISOLATION_MIG)
    ref = ref_of(claim)
    shares = tuple(claim_shares(claim, NODE))
    prepared = PreparedClaim(ref, shares, (PreparedDevice(("gpu",), NODE, "gpu-0", ("k=n",)),), (MIG,))
    PreparedClaims(tmp_path).add(prepared)
    [loaded] = PreparedClaims(tmp_path).prepared()  # a restarted agent
    assert loaded == prepared and loaded.mig_of(shares[0]) is None  # another device than MIG's
    assert loaded.mig[0].cap_minors == (21, 22)


def _pod(name: str, claim: str) -> Any:
    return pod_from_json(
        {
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {
                "nodeName": NODE,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}, {"name": "side"}],
            },
            "status": {"containerStatuses": [{"name": "c", "containerID": "containerd://c"}]},
        }
    )


def test_the_users_of_a_claim_get_exactly_its_instances() -> None:
    ref = ClaimRef("default", "train", "u-1")
    claim = PreparedClaim(ref, (), (), (MIG,))
    user, other = _pod("user", "train"), _pod("other", "infer")
    assert mig_grants([claim], [user, other]) == {
        ("uid-user", "c"): MigGrant(frozenset({0}), frozenset({21, 22}))
    }
    assert [p.name for p in claim_pods([user, other], ref)] == ["user"]
    assert mig_grants([PreparedClaim(ref, (), ())], [user]) == {}  # no instance, no grant


class _LateWatch:
    """Pods as the agent's cache has them, the claim's user delivered by the watch only while
    someone waits for it (kubelet prepares a claim for a pod the watch has not brought yet)."""

    def __init__(self, late: list[Any]) -> None:
        self.known: list[Any] = []
        self.late = late
        self.waits: list[float] = []

    def pods(self) -> list[Any]:
        return list(self.known)

    def wait_for(self, predicate: Any, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        if predicate():
            return True
        self.known += self.late  # the watch event: the cache changed, the predicate again
        return bool(predicate())


class _Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def pod(self, pod: Any, reason: str, message: str, warning: bool = True) -> None:
        self.posted.append((f"pod {pod.name}", reason))

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        self.posted.append(("node", reason))


def test_an_event_about_a_claim_waits_for_the_watch_to_bring_its_pod() -> None:
    ref = ClaimRef("default", "late", "u-2")
    watch, events = _LateWatch([_pod("late", "late")]), _Events()
    mig = ClaimMig(None, list, watch, events, wait_for_pod_s=3.0)  # type: ignore[arg-type]
    mig.report(ref, "MIGPrepareFailed", "placement taken")
    assert events.posted == [("pod late", "MIGPrepareFailed")] and watch.waits == [3.0]
    # A claim no pod of this node uses (its pod deleted): the node's, after the same wait.
    gone, events = _LateWatch([]), _Events()
    ClaimMig(None, list, gone, events, wait_for_pod_s=3.0).report(ref, "MIGUnprepareFailed", "busy")  # type: ignore[arg-type]
    assert events.posted == [("node", "MIGUnprepareFailed")] and gone.waits == [3.0]


def test_the_guard_merges_dra_instances_with_device_plugin_mig_devices() -> None:
    gpus = make_gpus()
    user = _pod("user", "train")
    pods = SimpleNamespace(
        pods=lambda: [user], get={user.uid: user}.get, stats=lambda: SimpleNamespace(synced=True)
    )
    targets = GuardTargets(pods, Ledger(gpus), gpus)  # type: ignore[arg-type]
    targets.add_mig(lambda: {(user.uid, "c"): MigGrant(frozenset({1}), frozenset({30}))}, frozenset)
    targets.add_mig_source(lambda: {(user.uid, "c"): MigGrant(frozenset({0}), frozenset({21, 22}))})
    assert targets.pod_policy(user.uid) == DevicePolicy(frozenset({0, 1}), frozenset({21, 22, 30}))
    [target] = targets()
    assert (target.gpu_minors, target.cap_minors) == (frozenset({0, 1}), frozenset({21, 22, 30}))


@pytest.mark.parametrize(("isolation", "device"), [(ISOLATION_MIG, "gpu-0"), (None, "gpu-0-mig-3g40gb-4")])
def test_without_dynamic_mig_a_share_that_needs_an_instance_is_refused(
    tmp_path: Path, isolation: str | None, device: str
) -> None:
    claim = copy.deepcopy(_claim(isolation, device))
    preparer = ClaimPreparer(
        node_name=NODE,
        gpus=GPUS,
        claims=FakeClaims(claim),
        responses=ResponseBuilder(DeviceListStrategy.MOUNTS, DRIVER_FILES, tmp_path / "host"),
        store=PreparedClaims(tmp_path / "state"),
        cdi_dir=tmp_path / "cdi",
    )
    with pytest.raises(ClaimError, match="needs a MIG instance, and dynamic MIG is off on node"):
        preparer.prepare(ref_of(claim))
    assert not (tmp_path / "cdi").exists() or not any((tmp_path / "cdi").iterdir())  # no spec left


class _Backend:
    """A backend whose GPU 0 reports ``info``; MIG control must never be reached."""

    def __init__(self, info: MigInfo) -> None:
        self.info = info

    def mig(self, index: int) -> MigInfo:
        return self.info

    def process_memory(self, index: int) -> list[object]:
        return [SimpleNamespace(pid=4242)]

    def mig_control(self) -> object:
        raise AssertionError("no MIG call on a GPU that cannot take it")


@pytest.mark.parametrize(
    ("info", "why"),
    [
        (MigInfo(capable=True, current=False, pending=True), "MIG mode is enabled, pending a GPU reset"),
        (MigInfo(capable=True, current=False, pending=False), "MIG mode is off"),
        (MigInfo(capable=True, current=True, pending=False), "to be disabled at the next GPU reset"),
        (MigInfo(capable=False), "GPU 0 has no MIG"),
    ],
)
def test_a_gpu_not_ready_for_dynamic_mig_is_refused_and_not_published(info: MigInfo, why: str) -> None:
    watch = SimpleNamespace(snapshot=lambda: (1, {0: info}), refresh=lambda: False)
    mig = DynamicMig(_Backend(info), GPUS[:1], lambda: {0}, watch)  # type: ignore[arg-type]
    assert mig.ready() == {}
    one = H100.by_name("1g.10gb") if H100 is not None else None
    assert one is not None
    with pytest.raises(DynamicMigError, match=why):
        mig.create(0, one, Placement(0, 1))
    with pytest.raises(DynamicMigError, match="not on dynamic MIG"):
        DynamicMig(_Backend(info), GPUS[:1], frozenset, watch).create(0, one, Placement(0, 1))  # type: ignore[arg-type]
    mig.reconcile(set())  # no instance to destroy; MIG mode off with a process on the GPU: left alone


def test_a_dynamic_gpu_that_dra_does_not_serve_is_left_out_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    info = MigInfo(capable=True, current=True, pending=False)
    watch = SimpleNamespace(snapshot=lambda: (1, {0: info}), refresh=lambda: False)
    mig = DynamicMig(_Backend(info), GPUS[:1], lambda: {0, 5}, watch)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="agent.control.dramig"):
        assert mig.gpus() == {0}
        assert mig.gpus() == {0}
    told = [r.getMessage() for r in caplog.records if "DRA does not serve" in r.getMessage()]
    assert told == ["mig.dynamic names GPU(s) 5 that DRA does not serve (see --dra-gpus): left as they are"]
