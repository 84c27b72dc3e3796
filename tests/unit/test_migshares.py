"""Isolated shares on demand (agent/control/migshares.py) on the NVML backend with the fake
pynvml: the smallest covering profile is created per share, refusals carry migfit's reason,
the checkpoint lets a new agent adopt the instances (and destroy orphans, but nothing when it
cannot be read), instances of gone pods are destroyed, an idle on-demand GPU is put in MIG
mode, the device guard gets exactly the instance's nodes, and the config is checked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from agent.control.migholdings import MigGrant, merged_grants
from agent.control.migsharebook import ShareKey, load_shares
from agent.control.migshares import MigShares
from agent.control.migwatch import MigWatch
from agent.domain.annotations import AnnotationError, wants_isolation
from agent.domain.migconfig import MigConfig, parse_mig
from agent.errors import AllocationError, InsufficientCapacityError
from agent.platform.gpu.nvml import NvmlBackend, open_nvml_backend
from agent.platform.kube.podcache import PodCache
from agent.platform.kube.pods import PodInfo
from tests.fakes.fake_nvml import FakeGpu
from tests.fakes.fake_nvml_mig import FakeMigNvml

H100 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
CONFIG = MigConfig(on_demand=frozenset({0}))


@pytest.fixture
def fake() -> FakeMigNvml:
    nvml = FakeMigNvml(
        [FakeGpu(H100, "00000000:07:00.0", 0, name="NVIDIA H100 80GB HBM3")], mig={0: "H100-80GB"}
    )
    nvml.mig(0).set_mode(1, None)
    nvml.mig(0).reset(None)  # in MIG mode, no instance
    return nvml


@pytest.fixture
def backend(fake: FakeMigNvml, tmp_path: Path) -> Iterator[NvmlBackend]:
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    yield backend
    backend.close()


@dataclass
class Stats:
    synced: bool = True


@dataclass
class Pods:
    """What MigShares asks the pod cache: whether it synced, and a pod by UID."""

    known: dict[str, PodInfo] = field(default_factory=dict)
    synced: bool = True

    def stats(self) -> Stats:
        return Stats(self.synced)

    def get(self, uid: str) -> PodInfo | None:
        return self.known.get(uid)


def shares_of(backend: NvmlBackend, checkpoint: Path | None, config: MigConfig = CONFIG) -> MigShares:
    gpus = backend.gpus()
    watch = MigWatch(backend, gpus)
    watch.refresh()
    return MigShares(backend, gpus, watch, lambda: config, checkpoint)


def key(name: str) -> ShareKey:
    return ShareKey(f"uid-{name}", "default", name, "cuda")


def test_each_share_gets_the_smallest_covering_instance(backend: NvmlBackend, tmp_path: Path) -> None:
    shares = shares_of(backend, tmp_path / "mig-shares.json")
    gpu = backend.gpus()[0]
    assert shares.ready() == {0} and shares.withheld({0: "in MIG mode"}) == {}
    two = shares.create(gpu, key("a"), 20, 10000)  # 20% of 132 SMs: 2g.20gb's 32
    three = shares.create(gpu, key("b"), 30, 20000)  # 30%: 3g.40gb's 60
    assert (two.profile, three.profile) == ("2g.20gb", "3g.40gb")
    assert shares.create(gpu, key("a"), 20, 10000).uuid == two.uuid  # kubelet asking again: the same one
    assert len(backend.mig(0).devices) == 2
    with pytest.raises(InsufficientCapacityError, match=r"no room on the GPU for a MIG instance of 3g\.40gb"):
        shares.create(gpu, key("c"), 30, 20000)
    with pytest.raises(
        InsufficientCapacityError, match=r"no H100-80GB MIG profile covers 10 cores and 90000"
    ):
        shares.create(gpu, key("d"), 10, 90000)
    grants = shares.grants()
    assert grants[("uid-a", "cuda")] == MigGrant(
        frozenset({0}),
        frozenset({3 + 9 * two.gi, 4 + 9 * two.gi}),  # gpu0/giG/access, ci0/access
    )
    assert {(s.pod, s.profile, s.uuid) for s in shares.shares()} == {
        ("a", "2g.20gb", two.uuid),
        ("b", "3g.40gb", three.uuid),
    }
    assert shares.release(key("a")) and [d.uuid for d in backend.mig(0).devices] == [three.uuid]
    saved, readable = load_shares(tmp_path / "mig-shares.json")
    assert readable and [s.uuid for s in saved] == [three.uuid]


def test_a_new_agent_adopts_the_instances_and_destroys_orphans(backend: NvmlBackend, tmp_path: Path) -> None:
    checkpoint = tmp_path / "mig-shares.json"
    first = shares_of(backend, checkpoint)
    kept = first.create(backend.gpus()[0], key("a"), 20, 10000)
    orphan = shares_of(backend, None).create(backend.gpus()[0], key("orphan"), 10, 5000)  # not checkpointed
    again = shares_of(backend, checkpoint)
    again.adopt()
    assert [s.uuid for s in again.shares()] == [kept.uuid]
    assert [d.uuid for d in backend.mig(0).devices] == [kept.uuid]  # the orphan is gone
    assert orphan.uuid != kept.uuid


def test_an_unreadable_checkpoint_destroys_nothing(backend: NvmlBackend, tmp_path: Path) -> None:
    checkpoint = tmp_path / "mig-shares.json"
    shares_of(backend, checkpoint).create(backend.gpus()[0], key("a"), 20, 10000)
    checkpoint.write_text('{"version": 1, "shares": [{"podUID": 7}]}')
    again = shares_of(backend, checkpoint)
    again.adopt()
    assert again.shares() == [] and len(backend.mig(0).devices) == 1


def test_instances_of_gone_pods_are_destroyed(backend: NvmlBackend, tmp_path: Path) -> None:
    shares = shares_of(backend, tmp_path / "mig-shares.json")
    pods = Pods(synced=False)
    shares.pods = cast(PodCache, pods)
    shares.create(backend.gpus()[0], key("a"), 20, 10000)
    shares.reconcile_once()
    assert len(shares.shares()) == 1  # the cache has not listed every pod: nothing is known gone
    pods.synced = True
    shares.reconcile_once()
    assert shares.shares() == [] and backend.mig(0).devices == ()


def test_an_idle_on_demand_gpu_is_put_in_mig_mode(fake: FakeMigNvml, tmp_path: Path) -> None:
    fake.mig(0).set_mode(0, None)
    fake.mig(0).reset(None)
    backend = open_nvml_backend(fake, sysfs_root=tmp_path)
    try:
        shares = shares_of(backend, None)
        assert shares.ready() == frozenset()
        assert "not in MIG mode yet" in shares.withheld({})[0]
        shares.reconcile_once()
        assert backend.mig(0).pending  # the fake, like a GPU that needs a reset
        assert "pending a GPU reset" in shares.withheld({})[0]
        with pytest.raises(AllocationError, match="pending a GPU reset"):
            shares.create(backend.gpus()[0], key("a"), 20, 10000)
    finally:
        backend.close()


def test_merged_grants_union_the_nodes_of_a_container() -> None:
    one = {("u", "c"): MigGrant(frozenset({0}), frozenset({12, 13}))}
    two = {
        ("u", "c"): MigGrant(frozenset({0}), frozenset({48, 49})),
        ("v", "c"): MigGrant(frozenset({1}), frozenset()),
    }
    merged = merged_grants(lambda: one, lambda: two)()
    assert merged[("u", "c")] == MigGrant(frozenset({0}), frozenset({12, 13, 48, 49}))
    assert merged[("v", "c")] == two[("v", "c")]


def test_on_demand_in_the_node_config() -> None:
    def parse(mig: object) -> tuple[MigConfig, list[str]]:
        problems: list[str] = []
        return parse_mig(mig, "cfg", problems), problems

    assert parse({"onDemand": [0, 1]})[0].on_demand == {0, 1}
    assert parse({})[0].on_demand == frozenset()
    _, problems = parse({"onDemand": [0], "geometry": {"0": ["3g.40gb"]}})
    assert any("also has a mig.geometry" in p for p in problems)
    for bad in ("0", [True], ["0"], [64], [-1]):
        config, problems = parse({"onDemand": bad})
        assert problems and config == MigConfig(), bad
    assert json.dumps(sorted(parse({"onDemand": [3]})[0].on_demand)) == "[3]"


def test_the_isolation_annotation_is_exactly_mig() -> None:
    assert wants_isolation({"nvidia.com/vcuda-isolation": "mig"}) is True
    assert wants_isolation({}) is False
    for value in ("MIG", "mig ", "", "hard", "mig,mps"):
        with pytest.raises(AnnotationError, match="the only value is 'mig'"):
            wants_isolation({"nvidia.com/vcuda-isolation": value})
