"""The DRA plugin's prepare/unprepare without gRPC: real claim JSON, real CDI files, a real
checkpoint; a new preparer on the same directories stands in for a restarted agent."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.control.draclaims import PreparedClaims
from agent.control.mpsgrants import MpsGrant
from agent.domain.dra import ClaimError, ClaimRef, PreparedClaim, PreparedDevice
from agent.domain.health import HealthBoard
from agent.errors import GpuUnhealthyError, KubeError, NoSuchGpuError, PlatformError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.mpspartition import Partition
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.preparer import ClaimPreparer
from tests.unit.cdischema import cdi_problems
from tests.unit.draobjects import (
    DRIVER_FILES,
    GPUS,
    NODE,
    FakeClaims,
    Result,
    allocated_claim,
    claim_manifest,
    ref_of,
)


@dataclass
class FakeMps:
    calls: list[tuple[int, int, int | None]]

    def grant_share(self, gpu: GpuInfo, ceiling: int, memory_mib: int | None) -> MpsGrant | None:
        self.calls.append((gpu.index, ceiling, memory_mib))
        return MpsGrant(
            gpu.index, Partition(ceiling, None, float(ceiling)), memory_mib, Path("/p"), Path("/l")
        )


@dataclass
class Node:
    root: Path
    claims: FakeClaims

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def checkpoint(self) -> Path:
        return self.root / "state" / "dra-prepared"

    def preparer(
        self,
        strategy: DeviceListStrategy = DeviceListStrategy.MOUNTS,
        mps: FakeMps | None = None,
        board: HealthBoard | None = None,
    ) -> ClaimPreparer:
        return ClaimPreparer(
            node_name=NODE,
            gpus=GPUS,
            claims=self.claims,
            responses=ResponseBuilder(strategy, DRIVER_FILES, self.root / "host"),
            store=PreparedClaims(self.checkpoint),
            cdi_dir=self.cdi,
            board=board,
            mps=mps,
        )

    def spec(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.cdi / f"vcuda.io-gpu_{uid}.json").read_text())
        return data


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, FakeClaims())


def add(node: Node, claim: dict[str, Any]) -> ClaimRef:
    node.claims.put(claim)
    return ref_of(claim)


def test_prepare_writes_a_cdi_spec_and_answers_its_ids(node: Node) -> None:
    ref = add(node, allocated_claim("train", [Result("gpu", 1, 30, "4Gi")]))
    prepared = node.preparer().prepare(ref)
    name = f"{ref.uid}-gpu-gpu1"
    assert prepared.devices == (PreparedDevice(("gpu",), NODE, "gpu-1", (f"vcuda.io/gpu={name}",)),)
    assert [(s.gpu_index, s.cores, s.memory_mib) for s in prepared.shares] == [(1, 30, 4096)]
    spec = node.spec(ref.uid)
    assert cdi_problems(spec) == []
    assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "vcuda.io/gpu")
    assert spec["annotations"] == {"gpu.vcuda.io/claim": "default/train"}
    [device] = spec["devices"]
    assert device["name"] == name
    edits = device["containerEdits"]
    host = node.root / "host"
    assert edits["deviceNodes"] == [
        {"path": p, "hostPath": f"{host}{p}", "permissions": "rw"}
        for p in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia3"]
    ]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["VCUDA_CORE"] == "30"
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["VCUDA_GPU_UUIDS"] == GPUS[1].uuid
    assert "LD_LIBRARY_PATH" not in env and "PATH" not in env  # the image's own stay
    assert {m["containerPath"]: m["options"] for m in edits["mounts"]} == {
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1": ["ro", "nosuid", "nodev", "bind"],
        "/usr/bin/nvidia-smi": ["ro", "nosuid", "nodev", "bind"],
    }
    assert not [p for p in node.cdi.iterdir() if p.name.startswith(".")]  # no temp file left


def test_modeset_is_added_where_the_host_has_it(node: Node) -> None:
    (node.root / "host" / "dev").mkdir(parents=True)
    (node.root / "host" / "dev" / "nvidia-modeset").touch()
    ref = add(node, allocated_claim("c"))
    node.preparer().prepare(ref)
    nodes = [n["path"] for n in node.spec(ref.uid)["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[-1] == "/dev/nvidia-modeset"


def test_prepare_twice_gives_the_same_answer_without_reading_again(node: Node) -> None:
    ref = add(node, allocated_claim("c"))
    preparer = node.preparer()
    first = preparer.prepare(ref)
    inode = os.stat(preparer.spec_path(ref.uid)).st_ino
    assert preparer.prepare(ref) == first
    assert node.claims.reads == 1
    assert os.stat(preparer.spec_path(ref.uid)).st_ino == inode


def test_a_lost_spec_file_is_written_again(node: Node) -> None:
    ref = add(node, allocated_claim("c"))
    preparer = node.preparer()
    first = preparer.prepare(ref)
    preparer.spec_path(ref.uid).unlink()
    assert preparer.prepare(ref) == first
    assert preparer.spec_path(ref.uid).exists()


def test_unprepare_removes_spec_and_record_and_unknown_is_fine(node: Node) -> None:
    ref = add(node, allocated_claim("c"))
    preparer = node.preparer()
    preparer.prepare(ref)
    preparer.unprepare(ref)
    assert not preparer.spec_path(ref.uid).exists()
    assert preparer.store.prepared() == []
    preparer.unprepare(ref)  # again: already done
    preparer.unprepare(ClaimRef("default", "never", "0c0c0c0c-0000-0000-0000-000000000000"))
    assert list(node.cdi.iterdir()) == []


def test_a_claim_with_another_uid_is_refused(node: Node) -> None:
    ref = add(node, allocated_claim("c", uid="11111111-1111-1111-1111-111111111111"))
    asked = ClaimRef(ref.namespace, ref.name, "22222222-2222-2222-2222-222222222222")
    with pytest.raises(ClaimError) as info:
        node.preparer().prepare(asked)
    assert str(info.value) == (
        "claim default/c has UID 11111111-1111-1111-1111-111111111111, "
        "kubelet asked for 22222222-2222-2222-2222-222222222222"
    )
    assert not node.cdi.exists() or list(node.cdi.iterdir()) == []


def test_an_unallocated_claim_is_refused(node: Node) -> None:
    claim = claim_manifest("pending")
    claim["metadata"]["uid"] = "33333333-3333-3333-3333-333333333333"
    with pytest.raises(ClaimError, match=r"claim default/pending is not allocated \(no status.allocation\)"):
        node.preparer().prepare(add(node, claim))


def test_a_claim_allocated_on_another_node_is_refused(node: Node) -> None:
    ref = add(node, allocated_claim("c", [Result("gpu", 0, pool="gpu-node-2")]))
    with pytest.raises(ClaimError, match=r"claim default/c: .*pool is 'gpu-node-2', not this node's pool"):
        node.preparer().prepare(ref)


def test_a_claim_without_our_devices_is_refused(node: Node) -> None:
    ref = add(node, allocated_claim("c", [Result("gpu", 0, driver="gpu.example.com")]))
    with pytest.raises(ClaimError, match=r"no device of driver gpu\.vcuda\.io allocated"):
        node.preparer().prepare(ref)


def test_a_missing_claim_is_refused_with_the_api_error(node: Node) -> None:
    with pytest.raises(KubeError, match="HTTP 404"):
        node.preparer().prepare(ClaimRef("default", "gone", "44444444-4444-4444-4444-444444444444"))


def test_a_gpu_the_node_lacks_or_an_unhealthy_one_is_refused(node: Node) -> None:
    with pytest.raises(NoSuchGpuError, match=r"gpu-7 is allocated, but node gpu-node-1 has GPUs \[0, 1\]"):
        node.preparer().prepare(add(node, allocated_claim("far", [Result("gpu", 7)])))
    board = HealthBoard([0, 1])
    board.set(0, False, "XID 79")
    with pytest.raises(GpuUnhealthyError, match=r"GPU 0 .* is Unhealthy: XID 79"):
        node.preparer(board=board).prepare(add(node, allocated_claim("sick", [Result("gpu", 0)])))


def test_a_restarted_agent_answers_the_same_and_unprepares(node: Node) -> None:
    ref = add(node, allocated_claim("c", [Result("a", 0), Result("b", 1, 50, "8Gi")]))
    first = node.preparer().prepare(ref)
    node.claims.claims.clear()  # the restarted agent must not need the API server
    again = node.preparer()
    assert again.store.prepared() == [first]
    assert again.prepare(ref) == first
    again.unprepare(ref)
    assert list(node.cdi.iterdir()) == []
    assert node.preparer().store.prepared() == []


def test_two_requests_get_two_devices_with_their_own_ids(node: Node) -> None:
    ref = add(node, allocated_claim("c", [Result("a", 0, 20), Result("b", 0, 40)]))
    prepared = node.preparer().prepare(ref)
    assert [d.requests for d in prepared.devices] == [("a",), ("b",)]
    names = [d["name"] for d in node.spec(ref.uid)["devices"]]
    assert names == [f"{ref.uid}-a-gpu0", f"{ref.uid}-b-gpu0"]
    cores = [
        dict(e.split("=", 1) for e in d["containerEdits"]["env"])["VCUDA_CORE"]
        for d in node.spec(ref.uid)["devices"]
    ]
    assert cores == ["20", "40"]


def test_cdi_strategy_also_names_nvidias_device(node: Node) -> None:
    ref = add(node, allocated_claim("c", [Result("gpu", 1)]))
    prepared = node.preparer(DeviceListStrategy.CDI).prepare(ref)
    assert prepared.devices[0].cdi_ids == (
        f"vcuda.io/gpu={ref.uid}-gpu-gpu1",
        f"nvidia.com/gpu={GPUS[1].uuid}",
    )
    edits = node.spec(ref.uid)["devices"][0]["containerEdits"]
    assert "deviceNodes" not in edits  # NVIDIA's spec brings them
    assert f"VCUDA_GPU_UUIDS={GPUS[1].uuid}" in edits["env"]


@pytest.mark.parametrize(("policy", "ceiling"), [(None, 30), ("burst-share", 100), ("best-effort", 100)])
def test_mps_limits_go_into_the_spec(node: Node, policy: str | None, ceiling: int) -> None:
    mps = FakeMps([])
    ref = add(node, allocated_claim("c", [Result("gpu", 0, 30, "4Gi")], policy=policy))
    node.preparer(mps=mps).prepare(ref)
    assert mps.calls == [(0, ceiling, 4096)]
    edits = node.spec(ref.uid)["devices"][0]["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(ceiling)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env["VCUDA_SHARING"] == "mps"
    pipe = next(m for m in edits["mounts"] if m["hostPath"] == "/p")
    assert pipe["options"][0] == "ro"


def test_a_whole_device_gets_no_mps_and_all_cores(node: Node) -> None:
    mps = FakeMps([])
    ref = add(node, allocated_claim("c", [Result("gpu", 0, None, None)]))
    prepared = node.preparer(mps=mps).prepare(ref)
    assert mps.calls == []
    assert prepared.shares[0].cores == 100
    assert "VCUDA_CORE=100" in node.spec(ref.uid)["devices"][0]["containerEdits"]["env"]


def test_subscribers_see_every_change(node: Node) -> None:
    ref = add(node, allocated_claim("c"))
    preparer = node.preparer()
    seen: list[list[PreparedClaim]] = []
    unsubscribe = preparer.store.subscribe(seen.append)
    preparer.prepare(ref)
    preparer.unprepare(ref)
    unsubscribe()
    preparer.prepare(ref)
    assert [[c.ref for c in claims] for claims in seen] == [[ref], []]


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_prepared(node: Node) -> None:
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text("a file where the checkpoint directory should be")
    ref = add(node, allocated_claim("c"))
    preparer = node.preparer()
    with pytest.raises(PlatformError, match="cannot create"):
        preparer.prepare(ref)
    assert list(node.cdi.iterdir()) == []
    assert preparer.store.prepared() == []


def test_unreadable_checkpoint_files_are_skipped_alone(node: Node) -> None:
    good = add(node, allocated_claim("good"))
    node.preparer().prepare(good)
    moved = add(node, allocated_claim("moved"))
    node.preparer().prepare(moved)
    (node.checkpoint / f"{moved.uid}.json").rename(node.checkpoint / "someone-else.json")
    (node.checkpoint / "torn.json").write_text('{"version": 1, "uid": 5')
    (node.checkpoint / "old.json").write_text('{"version": 0}')
    assert [c.ref for c in node.preparer().store.prepared()] == [good]


def test_one_checkpoint_file_per_claim(node: Node) -> None:
    refs = [add(node, allocated_claim(f"c{i}")) for i in range(3)]
    preparer = node.preparer()
    for ref in refs:
        preparer.prepare(ref)
    preparer.unprepare(refs[1])
    assert sorted(p.name for p in node.checkpoint.iterdir()) == sorted(
        f"{r.uid}.json" for r in (refs[0], refs[2])
    )
    assert oct(os.stat(node.checkpoint / f"{refs[0].uid}.json").st_mode & 0o777) == "0o600"


def test_kubelet_must_name_the_claim_fully(node: Node) -> None:
    with pytest.raises(ClaimError, match="without uid"):
        node.preparer().prepare(ClaimRef("default", "c", ""))
