"""What the node offers of its MIG devices by strategy (agent/domain/migoffer.py): resources
and device IDs, health, single's one-profile rule, and the GPUs withheld from shares."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from agent.domain.health import GpuHealth
from agent.domain.migconfig import MigStrategy
from agent.domain.migoffer import SINGLE_RESOURCE, MigOffer, mig_offer, mig_resource
from agent.platform.gpu.migstate import NOT_CAPABLE, MigDevice, MigInfo
from tests.unit.kubefixtures import make_gpus

GPUS = make_gpus(3)
HEALTHY = {i: GpuHealth(True, "", time.time()) for i in range(3)}


def device(gi: int, profile: str) -> MigDevice:
    return MigDevice(
        0, gi, gi, 0, f"MIG-{gi}", profile, profile, 9, 2, 0, 4, 40448, 60, 3 + 9 * gi, 4 + 9 * gi
    )


def offer(
    strategy: MigStrategy,
    *devices: MigDevice,
    unhealthy: Mapping[tuple[int, int], GpuHealth] | None = None,
    draining: Iterable[int] = (),
) -> MigOffer:
    infos = {0: MigInfo(True, True, True, devices), 1: MigInfo(True, False, True), 2: NOT_CAPABLE}
    return mig_offer(
        strategy, infos=infos, gpus=GPUS, health=HEALTHY, unhealthy_gis=unhealthy or {}, draining=draining
    )


def test_mixed_offers_a_resource_per_profile() -> None:
    found = offer(MigStrategy.MIXED, device(1, "3g.40gb"), device(2, "3g.40gb"), device(9, "1g.10gb+me"))
    assert {r: [d.id for d in ds] for r, ds in found.resources.items()} == {
        "nvidia.com/mig-3g.40gb": ["MIG-1", "MIG-2"],
        "nvidia.com/mig-1g.10gb.me": ["MIG-9"],  # "+" is no resource-name character
    }
    assert found.find("MIG-9") is not None and found.find("MIG-7") is None
    assert mig_resource("1c.3g.40gb") == "nvidia.com/mig-1c.3g.40gb"
    assert found.problem == ""


def test_single_needs_one_profile_and_none_offers_nothing() -> None:
    uniform = offer(MigStrategy.SINGLE, device(7, "1g.10gb"), device(8, "1g.10gb"))
    assert [d.id for d in uniform.resources[SINGLE_RESOURCE]] == ["MIG-7", "MIG-8"]
    mixed = offer(MigStrategy.SINGLE, device(1, "3g.40gb"), device(9, "1g.10gb"))
    assert mixed.resources == {}
    assert "only while they are all of one profile; this node has 1g.10gb, 3g.40gb" in mixed.problem
    none = offer(MigStrategy.NONE, device(1, "3g.40gb"))
    assert none.resources == {} and none.problem == "MIG strategy none: the MIG devices are not offered"


def test_withheld_gpus_say_why() -> None:
    found = offer(MigStrategy.MIXED, device(1, "3g.40gb"), draining={2})
    assert found.withheld[0].startswith("in MIG mode: it offers no shares of its own")
    assert found.withheld[1].startswith("MIG mode enabled, pending a GPU reset")
    assert found.withheld[2] == "a MIG geometry waits for it to be idle: it takes no new shares"
    assert 2 not in offer(MigStrategy.MIXED).withheld
    none = offer(MigStrategy.NONE, device(1, "3g.40gb"))
    assert "are not offered (MIG strategy none" in none.withheld[0]


def test_an_unhealthy_instance_is_an_unhealthy_device() -> None:
    bad = {(0, 2): GpuHealth(False, "XID 48", time.time())}
    found = offer(MigStrategy.MIXED, device(1, "3g.40gb"), device(2, "3g.40gb"), unhealthy=bad)
    health = {d.id: (d.healthy, d.reason) for d in found.resources["nvidia.com/mig-3g.40gb"]}
    assert health == {"MIG-1": (True, ""), "MIG-2": (False, "GPU instance 2 is Unhealthy: XID 48")}
