"""Dynamic MIG through DRA, end to end: a real agent (`vcuda-agent run --dra`) on a simulated
H100 in MIG mode that the node config gives to dynamic MIG, the emulated API server, the
emulated scheduler's DRA allocation (partitionable devices) and the kubelet DRA emulator on
the agent's real sockets. Placement claims get instances that do not overlap, created at
prepare and destroyed at unprepare (the simulated GPU's own truth says so); a restart keeps
the instances of checkpointed claims and destroys the others; a taken placement and an
instance in use are refused with a clear error and an Event; a hardware-isolated share gets
the smallest MIG profile that covers it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.domain.dra import CONFIG_API_VERSION, CONFIG_KIND, DRIVER, ClaimRef, claim_ref
from agent.emulators.draadmission import device_class
from agent.emulators.draallocator import DraAllocationError
from agent.emulators.draclaims import DraAllocator
from agent.emulators.kubelet_dra import KubeletDraEmulator, PrepareResult
from agent.platform.gpu.migcontrol import MigControl
from agent.platform.gpu.migprofiles import Placement, full_ci_profile, product
from agent.platform.gpu.sim.client import NodeClient
from agent.platform.gpu.sim.migclient import SimNvml
from tests.conftest import AgentProcess
from tests.integration.kubecluster import NODE, Cluster, wait_until
from tests.integration.migserver import mig_gpu_server

SPEC = "1xH100-80GB"
H100 = product("H100-80GB")


@dataclass
class Rig:
    cluster: Cluster
    kubelet: KubeletDraEmulator
    sim_dir: Path
    cdi_dir: Path
    start: Callable[[], AgentProcess]
    allocator: DraAllocator

    def truth(self) -> list[dict[str, Any]]:
        """The simulated GPU's MIG devices: (GI, placement, profile) with their UUIDs."""
        client = NodeClient(self.sim_dir / "gpu.sock", timeout_s=5.0)
        try:
            [gpu] = client.mig_state()
        finally:
            client.close()
        return list(gpu.get("devices") or [])

    def placements(self) -> set[tuple[str, int, int]]:
        return {(d["gi_profile"], d["placement_start"], d["placement_size"]) for d in self.truth()}

    def contexts(self, uuid: str) -> list[dict[str, Any]]:
        """The contexts running on a MIG device (``mig_truth``)."""
        client = NodeClient(self.sim_dir / "gpu.sock", timeout_s=5.0)
        try:
            devices = client.mig_truth()["devices"]
        finally:
            client.close()
        return [c for d in devices if d["uuid"] == uuid for c in d["contexts"]]

    def claim(
        self,
        name: str,
        *,
        profile: str | None = None,
        capacity: dict[str, str] | None = None,
        isolation: str | None = None,
    ) -> tuple[ClaimRef, dict[str, Any]]:
        """A claim and a pod on the node using it, allocated by the emulated scheduler."""
        exactly: dict[str, Any] = {"deviceClassName": "vcuda-gpu"}
        if profile is not None:
            exactly["selectors"] = [
                {"cel": {"expression": f"device.attributes['{DRIVER}'].profile == '{profile}'"}}
            ]
        if capacity is not None:
            exactly["capacity"] = {"requests": capacity}
        spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
        if isolation is not None:
            parameters = {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "isolation": isolation}
            spec["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
        manifest = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip
        self.cluster.api.create_object("resourceclaims", manifest, "default")
        pod = self.cluster.api.create_pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {
                    "nodeName": NODE,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [
                        {"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}
                    ],
                },
            }
        )
        claim = self.allocator.allocate("default", name, node=NODE, pod=pod)
        return claim_ref(claim), claim

    def prepare(self, ref: ClaimRef) -> PrepareResult:
        return self.kubelet.prepare(DRIVER, [ref])[ref.uid]

    def spec_env(self, ref: ClaimRef) -> dict[str, str]:
        spec = json.loads((self.cdi_dir / f"vcuda.io-gpu_{ref.uid}.json").read_text())
        [device] = spec["devices"]
        return dict(e.split("=", 1) for e in device["containerEdits"].get("env") or [])

    def spec_nodes(self, ref: ClaimRef) -> list[str]:
        spec = json.loads((self.cdi_dir / f"vcuda.io-gpu_{ref.uid}.json").read_text())
        [device] = spec["devices"]
        return [n["path"] for n in device["containerEdits"].get("deviceNodes") or []]

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.cluster.api.events() if e.get("reason") == reason]

    def slices(self) -> list[dict[str, Any]]:
        return self.cluster.api.objects("resourceslices")


def _allocated_device(claim: dict[str, Any]) -> str:
    [result] = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


@pytest.fixture
def sim_dir(short_dir: Path) -> Iterator[Path]:
    """The GPU server: GPU 0 in MIG mode with an instance nobody holds (a 1g.10gb)."""
    with mig_gpu_server(short_dir / "sim", SPEC, NODE, "0:1g.10gb", 30) as path:
        yield path


@pytest.fixture
def rig(
    sim_dir: Path, short_dir: Path, cluster: Cluster, start_agent: Callable[..., AgentProcess]
) -> Iterator[Rig]:
    config = short_dir / "config.json"
    config.write_text(json.dumps({"nodeConfig": [{"name": NODE, "mig": {"dynamic": [0]}}]}))
    registry, cdi = short_dir / "reg", short_dir / "cdi"
    args: tuple[str, ...] = ("--config", str(config), "--dra", "--dra-registry-dir", str(registry))
    args += ("--dra-plugin-dir", str(short_dir / "dra"), "--cdi-dir", str(cdi))
    kubelet = KubeletDraEmulator(registry)
    kubelet.start()
    cluster.api.create_object("deviceclasses", device_class())
    try:
        yield Rig(
            cluster, kubelet, sim_dir, cdi, lambda: start_agent(SPEC, *args, kube=cluster.kube),
            DraAllocator(cluster.api.store),
        )  # fmt: skip
    finally:
        kubelet.stop()


def published(rig: Rig) -> bool:
    names = {s["metadata"]["name"] for s in rig.slices()}
    return f"{NODE}-gpu.vcuda.io-gpu-0-counters" in names and f"{NODE}-gpu.vcuda.io" in names


def test_placements_are_created_at_prepare_destroyed_at_unprepare_and_kept_over_a_restart(rig: Rig) -> None:
    agent = rig.start()
    rig.kubelet.wait_for_plugin(DRIVER, timeout_s=30)
    wait_until(lambda: published(rig), 30, "the pool with its counter set")
    wait_until(lambda: rig.truth() == [], 30, "the instance no claim holds destroyed at start")
    [devices] = [s["spec"]["devices"] for s in rig.slices() if "devices" in s["spec"]]
    assert devices[0]["name"] == "gpu-0" and devices[0]["attributes"]["isolation"] == {"string": "mig"}
    assert "gpu-0-mig-3g40gb-4" in {d["name"] for d in devices}

    first, first_claim = rig.claim("first", profile="3g.40gb")
    second, second_claim = rig.claim("second", profile="3g.40gb")
    assert {_allocated_device(first_claim), _allocated_device(second_claim)} == {
        "gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"
    }  # fmt: skip
    for ref in (first, second):
        assert rig.prepare(ref).error == ""
    assert rig.placements() == {("3g.40gb", 0, 4), ("3g.40gb", 4, 4)}
    by_start = {d["placement_start"]: d for d in rig.truth()}
    mine = by_start[int(_allocated_device(first_claim).rsplit("-", 1)[1])]
    env = rig.spec_env(first)
    assert env["VCUDA_MIG_DEVICES"] == mine["uuid"] and env["NVIDIA_VISIBLE_DEVICES"] == mine["uuid"]
    caps = [n for n in rig.spec_nodes(first) if n.startswith("/dev/nvidia-caps/")]
    gi = mine["gi"]
    assert caps == [f"/dev/nvidia-caps/nvidia-cap{3 + 9 * gi}", f"/dev/nvidia-caps/nvidia-cap{4 + 9 * gi}"]
    assert rig.prepare(first).error == ""  # idempotent: no second instance
    assert len(rig.truth()) == 2

    assert rig.kubelet.unprepare(DRIVER, [first]) == {first.uid: ""}
    left = {("3g.40gb", int(_allocated_device(second_claim).rsplit("-", 1)[1]), 4)}
    assert rig.placements() == left

    # The agent stops; meanwhile someone creates an instance no claim holds.
    assert agent.stop() == 0
    with SimNvml(rig.sim_dir / "gpu.sock") as nvml:
        control = MigControl(nvml, lambda i: i, lambda _i: contextlib.nullcontext())
        assert H100 is not None
        one = H100.by_name("1g.10gb")
        assert one is not None
        free = ({0, 4} - {start for _, start, _ in left}).pop()
        control.create(0, one, Placement(free, 1), full_ci_profile(one, H100))
    assert len(rig.truth()) == 2
    rig.start()
    rig.kubelet.wait_for_plugin(DRIVER, timeout_s=30)
    wait_until(lambda: rig.placements() == left, 30, "the stray instance destroyed, the claim's kept")
    assert rig.prepare(second).error == ""  # answered from the checkpoint
    assert rig.kubelet.unprepare(DRIVER, [second]) == {second.uid: ""}
    assert rig.truth() == []


def test_a_taken_placement_and_an_instance_in_use_are_refused_with_an_event(rig: Rig) -> None:
    rig.start()
    rig.kubelet.wait_for_plugin(DRIVER, timeout_s=30)
    wait_until(lambda: published(rig) and rig.truth() == [], 30, "the pool published, the GPU clean")
    holder, holder_claim = rig.claim("holder", profile="7g.80gb")
    assert rig.prepare(holder).error == ""
    # A placement that overlaps an instance the node still has (a scheduler that lost track).
    rig.allocator.deallocate("default", "holder")
    taken, taken_claim = rig.claim("late", profile="3g.40gb")
    refused = rig.prepare(taken)
    assert f"claim default/late: {_allocated_device(taken_claim)}: GPU 0: placement" in refused.error
    assert "is taken by GPU instance" in refused.error and "7g.80gb at 0:8" in refused.error
    wait_until(lambda: rig.events("MIGPrepareFailed"), 10, "the Event")
    [event] = rig.events("MIGPrepareFailed")
    assert event["involvedObject"]["name"] == "late" and event["type"] == "Warning"

    [device] = rig.truth()
    workload = subprocess.Popen(
        [sys.executable, "-m", "agent", "sim-workload", "--sim-state-dir", str(rig.sim_dir), "--gpu", "0",
         "--mig", device["uuid"], "--pattern", "burn"]
    )  # fmt: skip
    try:
        wait_until(lambda: rig.contexts(device["uuid"]), 30, "the workload on the MIG device")
        busy = rig.kubelet.unprepare(DRIVER, [holder])[holder.uid]
        assert f"the driver refused destroying GPU instance {device['gi']}" in busy, busy
        assert "use it (In use by another client) (the instance stays)" in busy, busy
        wait_until(lambda: rig.events("MIGUnprepareFailed"), 10, "the Event")
        assert len(rig.truth()) == 1  # still there, and still recorded: kubelet asks again
    finally:
        workload.terminate()
        workload.wait(timeout=10)
    wait_until(lambda: rig.kubelet.unprepare(DRIVER, [holder]) == {holder.uid: ""}, 30, "unprepare once idle")
    assert rig.truth() == []
    assert _allocated_device(holder_claim) == "gpu-0-mig-7g80gb-0"


def test_an_isolated_share_gets_the_smallest_covering_profile(rig: Rig) -> None:
    rig.start()
    rig.kubelet.wait_for_plugin(DRIVER, timeout_s=30)
    wait_until(lambda: published(rig) and rig.truth() == [], 30, "the pool published, the GPU clean")
    # No profile has this much memory: refused with the rule, and an Event.
    big, _ = rig.claim("big", capacity={"cores": "100", "memory": "81300Mi"}, isolation="mig")
    refused = rig.prepare(big).error
    assert "no H100-80GB MIG profile covers 100 cores and 81300 MiB" in refused, refused
    wait_until(lambda: rig.events("MIGPrepareFailed"), 10, "the Event")
    assert rig.truth() == []
    rig.allocator.deallocate("default", "big")
    # 20 % of 132 SMs is 26.4: 1g.20gb (26 SMs) falls short, 2g.20gb (32) covers it.
    share, share_claim = rig.claim("share", capacity={"cores": "20", "memory": "8Gi"}, isolation="mig")
    assert _allocated_device(share_claim) == "gpu-0"
    assert rig.prepare(share).error == ""
    [device] = rig.truth()
    assert device["gi_profile"] == "2g.20gb"
    assert rig.spec_env(share)["VCUDA_MIG_DEVICES"] == device["uuid"]
    # While shares hold the GPU, the scheduler gives none of its placements.
    with pytest.raises(DraAllocationError, match="counter gpu-0-counters"):
        rig.claim("placement", profile="1g.10gb")
    assert rig.kubelet.unprepare(DRIVER, [share]) == {share.uid: ""}
    assert rig.truth() == []
