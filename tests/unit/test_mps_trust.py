"""MPS v3: a share whose processes run as the MPS daemon's uid (root, as the agent runs it)
could change its own namespace's limit through the control socket every client reaches, so
it is not trusted to it; the freezer holds it, blind where NVML credits its work to the MPS
server. Shares not seen yet are not trusted either; non-root ones are."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.control.mpsgrants import MpsGrant
from agent.control.mpstrust import PENDING, NamespaceTrust, read_uids
from agent.domain.annotations import Policy
from agent.platform.gpu.mpspartition import Partition
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec
from tests.unit.enforcer_plant import Rig, spec

ROOT, TENANT = frozenset({0}), frozenset({1000})


def test_a_share_is_trusted_only_once_a_reading_shows_no_process_of_the_daemons_uid() -> None:
    trust = NamespaceTrust(daemon_uid=0)
    assert trust.update({"a/c": (0, frozenset())}) == []
    assert trust.why_not("a/c") == PENDING  # no process read yet: not trusted
    assert trust.update({"a/c": (0, TENANT)}) == []
    assert trust.why_not("a/c") is None
    # every uid field counts: a saved uid of 0 lets a process switch back to root
    moved = trust.update({"a/c": (0, frozenset({1000, 0}))})
    assert [(m.key, m.was_trusted) for m in moved] == [("a/c", True)]
    assert "runs as uid 0, the MPS daemon's user" in moved[0].why and "freezer" in moved[0].why
    assert trust.update({"a/c": (0, TENANT)}) == []  # the limit it may have set stays set
    assert trust.why_not("a/c") == moved[0].why
    trust.update({})  # the share went
    assert trust.why_not("a/c") == PENDING


def test_a_root_share_taints_the_shares_of_its_gpu_only() -> None:
    trust = NamespaceTrust(daemon_uid=0)
    trust.update({"a/c": (0, TENANT), "b/c": (1, TENANT)})
    moved = trust.update({"a/c": (0, TENANT), "b/c": (1, TENANT), "r/c": (0, ROOT)})
    assert {m.key for m in moved} == {"a/c", "r/c"}
    assert "r/c on the same GPU runs as uid 0" in (trust.why_not("a/c") or "")
    assert trust.why_not("b/c") is None


def test_the_daemons_uid_is_what_counts_not_root() -> None:
    trust = NamespaceTrust(daemon_uid=999)
    trust.update({"a/c": (0, ROOT), "b/c": (1, frozenset({999}))})
    assert trust.why_not("a/c") is None
    assert "runs as uid 999" in (trust.why_not("b/c") or "")


def grant(namespace: str | None) -> MpsGrant:
    return MpsGrant(0, Partition(10, 12, 9.1), None, Path("/p"), Path("/l"), False, namespace)


def test_only_shares_with_a_namespace_are_read_and_a_lost_one_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trust = NamespaceTrust(daemon_uid=0)
    users = {"a": TENANT, "b": ROOT}
    asked: list[str] = []

    def uids_of(pod: str, _container: str) -> frozenset[int]:
        asked.append(pod)
        return users[pod]

    grants = [("a/c", grant("vc-a")), ("b/c", grant(None))]
    trust.update(read_uids(grants, uids_of))
    assert asked == ["a"] and trust.why_not("a/c") is None
    users["a"] = ROOT  # e.g. a setuid-root program it ran
    with caplog.at_level(logging.WARNING):
        trust.update(read_uids(grants, uids_of))
    assert "a/c runs as uid 0" in caplog.text and "was on its namespace limit until now" in caplog.text
    fresh = NamespaceTrust(daemon_uid=0)
    fresh.update(read_uids(grants, None))  # nothing to read uids by: nothing is trusted
    assert fresh.why_not("a/c") == PENDING


def test_the_freezer_holds_an_untrusted_mps_client_it_cannot_measure_to_its_share() -> None:
    # NVML credits an MPS client's work to the MPS server: the duty loop cannot measure it,
    # so without the blind hold it ran unheld at whatever its namespace says (here 100 %).
    held = {"cheat": 30.0}
    config = EngineConfig.ideal()
    rig = Rig(config, feedback="nvml", untrusted=lambda s: held.get(s.pod), uncredited=frozenset({"cheat"}))
    rig.add("cheat", PatternSpec("train"), spec("cheat", 30, Policy.BEST_EFFORT))
    rig.run_for(10)
    assert rig.mean("cheat", 2, 8) == pytest.approx(30, abs=3)
    assert rig.control("cheat").throttled and rig.control("cheat").held_blind
    held.clear()  # trusted now: the loop's own duty again (a best-effort: unheld), nothing blind left
    rig.run_for(5)
    assert not rig.control("cheat").held_blind and not rig.control("cheat").throttled
    assert rig.mean("cheat", 12, 3) > 95
