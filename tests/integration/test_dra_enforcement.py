"""The agent as a DRA driver end to end, as a real process (`vcuda-agent run --dra`): it
publishes a ResourceSlice, the emulated allocator allocates a claim for 30 cores and 4 GiB from
it, the kubelet DRA emulator prepares it over the agent's socket, the workload starts with the
CDI environment, and the agent holds it at 30 % on the GPU engine, through the same ledger,
specs and controller as a device-plugin share. One GPU serves each entry path on the same node
(``--dra-gpus``), and neither counts the other's.

Asserted here are the mechanics a loaded 2-core host cannot break (held, frozen and thawed,
what status and /metrics say); how accurately the shares are held, in virtual time:
tests/unit/test_shares_virtual.py and tests/unit/test_enforcer.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.domain.dra import DRIVER, claim_ref
from agent.emulators.draadmission import ClaimPods
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen_then_thawed, wait_for
from agent.emulators.kubelet_dra import KubeletDraEmulator
from agent.surfaces.statusclient import fetch_status
from tests.integration.cgroup_trees import real_layout

HELD_S = 60.0  # the longest a share is given to be seen held on a loaded host
MEASURE_S = 2.0
HELD_BOUND = 90  # alone on its GPU, a share held to 30, 50 or 60 gets well under this


@dataclass
class DraRig:
    node: EnforcedNode
    kubelet: KubeletDraEmulator
    pods: ClaimPods

    def status(self) -> dict[str, Any]:
        return fetch_status(self.node.state_dir / "status.sock")

    def rows(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """pod name -> (GPU index, its container row in status)."""
        return {c["pod"]: (g["index"], c) for g in self.status()["gpus"] for c in g.get("containers") or []}


def held(rig: DraRig, *pods: str) -> bool:
    """Every one of ``pods`` held (throttled) by the agent."""
    rows = rig.rows()
    return all(rows.get(pod, (0, {}))[1].get("throttled") for pod in pods)


@pytest.fixture
def rig(short_dir: Path) -> Iterator[DraRig]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    registry, cdi = short_dir / "reg", short_dir / "cdi"
    kubelet = KubeletDraEmulator(registry)
    kubelet.start()
    args: tuple[str, ...] = ("--device-guard", "off", "--no-ioctl-tracing", "--dra", "--dra-gpus", "1")
    args += (
        "--dra-registry-dir",
        str(registry),
        "--dra-plugin-dir",
        str(short_dir / "dra"),
        "--cdi-dir",
        str(cdi),
    )
    try:
        with enforced_node(short_dir / "n", "2xH100-80GB", agent_args=args) as node:
            kubelet.wait_for_plugin(DRIVER, timeout_s=30)
            yield DraRig(node, kubelet, ClaimPods(node, kubelet, cdi))
    finally:
        kubelet.stop()


def test_a_claim_for_30_cores_and_4_gib_is_held_at_30_percent(rig: DraRig) -> None:
    published = rig.pods.wait_for_slice()
    assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-1"]  # GPU 0 is the device plugin's
    plugin_pod = rig.node.run_pod("plugin-share", 50)  # the device plugin's GPU, the other path
    claimed = rig.pods.run("dra-share", 30, 4096)
    assert claimed.gpu == 1
    wait_for(lambda: held(rig, "dra-share", "plugin-share"), HELD_S, "each held on its own GPU")
    frozen_then_thawed(claimed.box.cgroup, HELD_S, "the claim's container")
    frozen_then_thawed(plugin_pod.cgroup, HELD_S, "the device plugin's container")
    used_claim, used_plugin = rig.node.utilization([claimed.box, plugin_pod], MEASURE_S)
    assert 0 < used_claim < HELD_BOUND and 0 < used_plugin < HELD_BOUND, (used_claim, used_plugin)
    gpu, row = rig.rows()["dra-share"]
    assert (gpu, row["capPercent"], row["memoryQuotaMiB"], row["policy"]) == (1, 30, 4096, "fixed-share")
    metrics = rig.node.metrics()
    for line in (
        "vcuda_dra_plugin_registered{node=",
        "vcuda_dra_prepared_claims{node=",
        "vcuda_dra_slice_devices{node=",
    ):
        [sample] = [m for m in metrics.splitlines() if m.startswith(line)]
        assert sample.endswith(" 1.0"), sample
    cap = (
        'vcuda_container_cap_ratio{container="c",gpu="1",namespace="default",node="sim-node",pod="dra-share"}'
    )
    assert f"{cap} 0.3" in metrics
    assert rig.status()["agent"]["dra"].startswith("registered; prepared claims: 1; slice generation")
    gpus = {g["index"]: g for g in rig.status()["gpus"]}
    assert (gpus[0]["coresAllocated"], gpus[1]["coresAllocated"]) == (50, 30)


def test_an_unprepared_claim_leaves_the_ledger(rig: DraRig) -> None:
    rig.pods.wait_for_slice()
    claimed = rig.pods.run("brief", 20, 1024, policy="burst-share")
    wait_for(lambda: "brief" in rig.rows(), 10, "the claim in the ledger")
    assert rig.rows()["brief"][1]["policy"] == "burst-share"
    claimed.box.proc.kill()
    ref = claim_ref(claimed.claim)
    assert rig.kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
    wait_for(lambda: "brief" not in rig.rows(), 10, "the claim gone from the ledger")


def test_two_claims_on_one_gpu_are_each_held_to_their_consumed_cores(rig: DraRig) -> None:
    rig.pods.wait_for_slice()
    small = rig.pods.run("claim-30", 30, 2048)
    large = rig.pods.run("claim-60", 60, 2048)
    assert small.gpu == large.gpu == 1  # the one device in the slice, consumed 30 + 60 of its 100
    wait_for(lambda: held(rig, "claim-30", "claim-60"), HELD_S, "both claims held at their consumed cores")
    rows = rig.rows()
    assert (rows["claim-30"][1]["capPercent"], rows["claim-60"][1]["capPercent"]) == (30, 60)
    frozen_then_thawed(small.box.cgroup, HELD_S, "the claim of 30")
    frozen_then_thawed(large.box.cgroup, HELD_S, "the claim of 60")
    # How exactly the two split the GPU is asserted in virtual time
    # (tests/unit/test_enforcer.py::test_two_fixed_share_neighbours_each_hold_their_cap).
    used_small, used_large = rig.node.utilization([small.box, large.box], MEASURE_S)
    assert 0 < used_small < HELD_BOUND and 0 < used_large < HELD_BOUND, (used_small, used_large)
