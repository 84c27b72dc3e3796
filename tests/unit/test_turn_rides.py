"""Turn ends that ride on wake-ups made for other GPUs (``TurnSettings.ride_s``): on a full
node the loop wakes for each GPU's freezes and thaws, and a wake-up costs the agent more
than the work in it. On a crowded GPU a plain turn that would end a little before another
GPU's planned action runs on to it, and one that would end a little after a wake-up the loop
makes anyway ends in it. In virtual time the loop wakes far less often, and every share
holds as before (the node runner is ``bench/turn_rides.py``'s)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.domain.turns import TurnSettings
from agent.platform.gpu.sim.programs import PatternSpec
from tests.unit.enforcer_plant import Rig, spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from turn_rides import full_node, run


@pytest.mark.parametrize(
    "pattern",
    [PatternSpec("train", kernel_ms=2.0), PatternSpec("graph", kernel_ms=1.0), PatternSpec("infer")],
    ids=["train", "graph", "infer"],
)
def test_on_a_full_node_the_loop_wakes_less_and_every_share_holds(pattern: PatternSpec) -> None:
    """The footprint benchmark's node: 8 GPUs of 16 fixed-share 6 % containers under one
    enforcer, 10 s to settle, 40 s measured."""
    members, periods = full_node(pattern)
    alone = run(members, periods, TurnSettings(ride_s=0.0), 0.0, 40.0, settle_s=10.0)
    riding = run(members, periods, TurnSettings(), 0.0, 40.0, settle_s=10.0)
    # Measured here: 62-70 wake-ups a second without rides, 20-46 with.
    assert riding.wakeups_per_s <= 0.8 * alone.wakeups_per_s, (riding.wakeups_per_s, alone.wakeups_per_s)
    # As many turns (a freeze each) as before: rides move turn ends, they add no turns.
    assert riding.freezes_per_s <= 1.05 * alone.freezes_per_s, (riding.freezes_per_s, alone.freezes_per_s)
    # Each share as close to its 6 as before (a turn in a 2-3 s cycle more or less in the
    # window moves one by about 0.2 pp): the highest, the lowest and the mean.
    before, after = sorted(alone.uses.values()), sorted(riding.uses.values())
    assert after[-1] <= max(6.5, before[-1] + 0.25), (before, after)
    assert after[0] >= min(5.0, before[0] - 0.25), (before, after)
    assert sum(after) / len(after) >= sum(before) / len(before) - 0.15, (before, after)


def test_a_gpu_alone_on_its_node_takes_the_same_turns_with_rides_or_without() -> None:
    """One GPU: no other GPU's wake-ups to ride on, and the periods' own wake-ups come where
    no turn is that close to its end: the same freezes and thaws to the instant."""
    logs = []
    for settings in (TurnSettings(), TurnSettings(ride_s=0.0)):
        rig = Rig(turns=settings)
        for name, cores in (("a", 30), ("b", 20), ("c", 6), ("d", 6)):
            rig.add(name, PatternSpec("train", kernel_ms=3.0), spec(name, cores))
        rig.run_for(15.0)
        logs.append({name: list(c.freezes) for name, c in rig.gpu.containers.items()})
    assert logs[0] == logs[1]
    assert all(len(freezes) > 10 for freezes in logs[0].values())
