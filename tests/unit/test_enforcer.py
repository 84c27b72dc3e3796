"""The enforcer's loop against a model GPU, in virtual time: caps, policies, safety."""

from __future__ import annotations

import threading

import pytest

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.errors import PlatformError
from tests.unit.enforcer_plant import ModelGpu

PERIOD = 0.25


def spec(
    name: str,
    cores: int,
    policy: Policy = Policy.FIXED_SHARE,
    cap: int | None = None,
    limit_set: bool = False,
) -> EnforcementSpec:
    whole = cores >= 100
    return EnforcementSpec(
        pod_uid=f"uid-{name}",
        namespace="default",
        pod=name,
        container="c",
        container_id=f"cid-{name}",
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=cores,
        cap=None if whole else (cap if cap is not None else cores),
        memory_quota_mib=None if whole else 1024,
        policy=policy,
        limit_set=limit_set,
    )


class Rig:
    def __init__(self, lag_s: float = 0.0, tick_s: float = 0.2) -> None:
        self.clock = VirtualClock()
        self.gpu = ModelGpu(self.clock, tick_s=tick_s, lag_s=lag_s)
        self.specs: list[EnforcementSpec] = []
        self.enforcer = Enforcer(
            gpus=[0],
            samples=self.gpu,
            specs=lambda: self.specs,
            owner_of=self.gpu.owner_of,
            locate=lambda s: ThrottleTarget(s.container_id, None, None),
            actuator=self.gpu,
            period_s=PERIOD,
            clock=self.clock,
        )
        self.start = self.clock.monotonic()

    def add(self, name: str, demand: float, item: EnforcementSpec) -> None:
        self.gpu.add(name, 100 + len(self.specs), demand)
        self.specs.append(item)

    def run_for(self, seconds: float) -> None:
        end = self.clock.monotonic() + seconds
        while self.clock.monotonic() < end:
            self.enforcer.period()
            remaining = PERIOD - (self.clock.monotonic() - self.start) % PERIOD
            self.clock.sleep(remaining)
        self.gpu.advance()

    def mean(self, name: str, after_s: float, seconds: float) -> float:
        begin = self.start + after_s
        return self.gpu.mean_util(name, begin, begin + seconds)


@pytest.mark.parametrize("cap", [30, 50, 80])
def test_fixed_share_holds_its_cap(cap: int) -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", cap))
    rig.run_for(23)
    assert rig.mean("a", 3, 20) == pytest.approx(cap, abs=1.5)
    assert rig.gpu.longest_freeze("a") <= PERIOD + 1e-9


def test_fixed_share_holds_its_cap_when_samples_arrive_a_second_late() -> None:
    rig = Rig(lag_s=1.0)
    rig.add("a", 1.0, spec("a", 40))
    rig.run_for(30)
    assert rig.mean("a", 8, 20) == pytest.approx(40, abs=3)


def test_two_fixed_share_neighbours_each_hold_their_cap() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30))
    rig.add("b", 1.0, spec("b", 60))
    rig.run_for(23)
    assert rig.mean("a", 3, 20) == pytest.approx(30, abs=3)
    assert rig.mean("b", 3, 20) == pytest.approx(60, abs=3)


def test_a_workload_below_its_cap_is_not_throttled() -> None:
    rig = Rig()
    rig.add("a", 0.2, spec("a", 50))
    rig.run_for(10)
    assert rig.mean("a", 3, 7) == pytest.approx(20, abs=1)
    assert rig.enforcer.controls()[0].state.duty == 1.0


def test_burst_share_uses_idle_capacity_and_gives_it_back() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30, Policy.BURST_SHARE))
    rig.run_for(5)
    assert rig.mean("a", 2, 3) >= 90
    rig.specs.append(spec("b", 50, Policy.BURST_SHARE))
    rig.gpu.add("b", 200, 1.0)
    joined = rig.clock.monotonic() - rig.start
    rig.run_for(13)
    assert rig.mean("a", joined + 3, 10) <= 33
    assert rig.mean("b", joined + 3, 10) >= 47


def test_burst_share_with_a_limit_bursts_only_to_it() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30, Policy.BURST_SHARE, cap=60, limit_set=True))
    rig.run_for(13)
    assert rig.mean("a", 3, 10) == pytest.approx(60, abs=3)


@pytest.mark.parametrize(
    "item", [spec("a", 30, Policy.BEST_EFFORT), spec("a", 100)], ids=["best-effort", "whole-gpu"]
)
def test_best_effort_and_whole_gpus_are_never_frozen(item: EnforcementSpec) -> None:
    rig = Rig()
    rig.add("a", 1.0, item)
    rig.run_for(5)
    assert rig.gpu.containers["a"].freeze_log == []
    assert rig.mean("a", 1, 4) >= 99


def test_a_stopped_loop_leaves_nothing_frozen() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30))
    stop = threading.Event()
    rig.run_for(2)  # measured over its cap: frozen at the end of each period
    assert rig.gpu.containers["a"].frozen
    stop.set()
    rig.enforcer.run(stop)  # returns at once, thawing on the way out
    assert not rig.gpu.containers["a"].frozen


def test_a_container_whose_spec_goes_is_released() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30))
    rig.run_for(2)
    rig.specs.clear()
    rig.run_for(1)
    assert not rig.gpu.containers["a"].frozen
    assert rig.enforcer.controls() == []


def test_a_failed_thaw_is_retried_at_the_next_period() -> None:
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30))
    real_thaw = rig.gpu.thaw
    failures = [PlatformError("EBUSY (injected)")]

    def flaky_thaw(target: ThrottleTarget) -> None:
        if failures:
            raise failures.pop()
        real_thaw(target)

    rig.run_for(2)
    assert rig.gpu.containers["a"].frozen
    rig.gpu.thaw = flaky_thaw  # type: ignore[method-assign]
    rig.enforcer.period()  # its thaw fails: still frozen, and known to be
    assert rig.enforcer.controls()[0].frozen
    rig.enforcer.period()  # retried
    assert rig.enforcer.stats.actuator_errors == 1
    assert rig.gpu.longest_freeze("a") <= 2 * PERIOD + 0.05
    rig.enforcer.release_all()
    assert not rig.gpu.containers["a"].frozen


def test_a_throttled_container_that_goes_idle_is_released() -> None:
    # An idle GPU sends no per-process samples at all: that silence must read as idleness.
    rig = Rig()
    rig.add("a", 1.0, spec("a", 30))
    rig.run_for(4)
    assert rig.enforcer.controls()[0].throttled
    rig.gpu.set_demand("a", 0.0)
    rig.run_for(6)
    control = rig.enforcer.controls()[0]
    assert (control.throttled, control.state.duty, rig.gpu.containers["a"].frozen) == (False, 1.0, False)
