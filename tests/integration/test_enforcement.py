"""Compute caps on the simulated GPU engine with real containers: a real agent process
measures real workload processes through late NVML-style samples and freezes their real
cgroups, while the GPU server (outside every container) keeps executing what they queued.

Tolerances are the compute caps' targets (±3 pp over 20 s after settling) on this noisy
2-core machine; what a container got is the GPU server's ground truth, not what the samples
said.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.domain.annotations import CORE_LIMIT, POLICY
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen, wait_for
from agent.surfaces.statusclient import fetch_status
from tests.integration.cgroup_trees import real_layout

SETTLE_S = 5.0
MEASURE_S = 20.0
# An unthrottled train loop leaves the GPU idle while its host thread syncs and submits
# the next step; with the parallel suite beside it on 2 cores that gap reached 12 % on
# CI. Any cap these tests use (30, 50) stays far below this floor.
UNTHROTTLED_FLOOR = 80


@pytest.fixture
def rig(short_dir: Path) -> Iterator[EnforcedNode]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    with enforced_node(short_dir, agent_args=("--device-guard", "off", "--no-ioctl-tracing")) as node:
        yield node


def agent_status(node: EnforcedNode) -> dict[str, Any]:
    return fetch_status(node.state_dir / "status.sock")


@pytest.mark.parametrize("cap", [30, 60])
def test_fixed_share_holds_its_cap_on_training_steps(rig: EnforcedNode, cap: int) -> None:
    box = rig.run_pod("capped", cap)  # the train pattern: steps of 20 x 2 ms kernels, then a sync
    time.sleep(SETTLE_S)
    (used,) = rig.utilization([box], MEASURE_S)
    assert used == pytest.approx(cap, abs=3), f"cap {cap}: used {used:.1f}%"


def test_two_fixed_share_neighbours_each_hold_their_cap(rig: EnforcedNode) -> None:
    small = rig.run_pod("small", 30)
    large = rig.run_pod("large", 60)
    time.sleep(SETTLE_S)
    used_small, used_large = rig.utilization([small, large], MEASURE_S)
    assert used_small == pytest.approx(30, abs=3)
    assert used_large == pytest.approx(60, abs=3)


def test_burst_share_borrows_idle_time_and_gives_it_back(rig: EnforcedNode) -> None:
    first = rig.run_pod("first", 30, annotations={POLICY: "burst-share"})
    time.sleep(SETTLE_S)
    (alone,) = rig.utilization([first], 4)
    assert alone >= UNTHROTTLED_FLOOR
    second = rig.run_pod("second", 50, annotations={POLICY: "burst-share"})
    time.sleep(SETTLE_S)
    used_first, used_second = rig.utilization([first, second], 8)
    assert used_first == pytest.approx(30, abs=4)
    assert used_second >= 46


@pytest.mark.parametrize(
    ("cores", "annotations"), [(30, {POLICY: "best-effort"}), (100, {})], ids=["best-effort", "whole-gpu"]
)
def test_best_effort_and_whole_gpus_are_never_frozen(
    rig: EnforcedNode, cores: int, annotations: dict[str, str]
) -> None:
    box = rig.run_pod("free", cores, annotations=annotations)
    seen_frozen = False
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        seen_frozen = seen_frozen or frozen(box.cgroup)
        time.sleep(0.01)
    assert not seen_frozen
    (used,) = rig.utilization([box], 3)
    assert used >= UNTHROTTLED_FLOOR
    doc = agent_status(rig)
    (row,) = doc["gpus"][0]["containers"]
    assert row["throttled"] is False and row["frozen"] is False


def test_status_shows_the_throttled_container(rig: EnforcedNode) -> None:
    rig.run_pod("shown", 40, annotations={CORE_LIMIT: "40"})
    time.sleep(SETTLE_S)
    doc = agent_status(rig)
    (row,) = doc["gpus"][0]["containers"]
    assert (row["pod"], row["policy"], row["capPercent"], row["throttled"]) == (
        "shown",
        "fixed-share",
        40,
        True,
    )
    assert 0.2 < row["duty"] < 0.6
    assert 0.25 <= row["cycleSeconds"] <= 2.0  # the mean time between its turns
    assert row["unholdable"] is None
    assert any(
        a["action"] == "throttled" and a["container"] == "default/shown/c" for a in doc["recentActions"]
    )
    metrics = rig.metrics()

    def sample(name: str, labels: str) -> float:
        found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", metrics, re.M)
        assert found, f"{name}{{{labels}}} not in /metrics"
        return float(found[1])

    mine = 'container="c",gpu="0",namespace="default",node="sim-node",pod="shown"'
    assert 0.2 < sample("vcuda_container_throttle_duty_ratio", mine) < 0.6
    assert 0.25 <= sample("vcuda_container_throttle_cycle_seconds", mine) <= 2.0
    assert sample("vcuda_container_share_unholdable", mine) == 0
    assert 0.3 < sample("vcuda_container_gpu_utilization_ratio", mine) < 0.5
    assert sample("vcuda_container_frozen_seconds_total", mine) > 0.5
    assert sample("vcuda_control_loop_duration_seconds_count", 'node="sim-node"') > 8


def test_sigkilled_agent_leaves_nothing_frozen_and_a_restart_resumes(rig: EnforcedNode) -> None:
    boxes = [rig.run_pod(f"held-{i}", 20) for i in range(3)]
    wait_for(lambda: any(frozen(b.cgroup) for b in boxes), 5, "a container frozen by the duty cycle")
    # Kill the agent at a moment when at least one container is frozen.
    wait_for(lambda: sum(frozen(b.cgroup) for b in boxes) >= 2, 5, "two containers frozen at once")
    rig.agent.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    rig.agent.wait()
    wait_for(lambda: not any(frozen(b.cgroup) for b in boxes), 1.0, "every container thawed")
    assert time.monotonic() - killed <= 1.0
    used = rig.utilization(boxes, 2)
    # Unthrottled, the three time-slice the GPU (less the context switches between them).
    assert all(u > 25 for u in used), f"each over its cap of 20: {used}"
    rig.start_agent()
    # A new agent learns each container's drains again: turns settle in 9-22 s at the defaults
    # (docs/benchmarks.md). Held again means: an 8 s window with every one within 4 pp of its
    # cap by 30 s after the restart (one fixed wait of 10 s once left one at 24.0).
    restarted = time.monotonic()
    time.sleep(SETTLE_S + 5)
    used = rig.utilization(boxes, 8)
    while not all(u == pytest.approx(20, abs=4) for u in used) and time.monotonic() - restarted < 30:
        used = rig.utilization(boxes, 8)
    assert all(u == pytest.approx(20, abs=4) for u in used), used


def test_a_container_over_its_memory_quota_loses_the_process_that_went_over(rig: EnforcedNode) -> None:
    # The neighbour stays well under its cap: at its cap (20 at busy 0.2) it is held, and the
    # held turns of a container that keeps the GPU a fifth busy leave a yielding one no time
    # (bench/neighbours.py; docs/enforcement.md, "Known limits"): the grower never grew.
    neighbour = rig.run_pod("neighbour", 30, memory_mib=2048, busy=0.2, workload_mib=1500)
    grower = rig.run_pod(
        "grower",
        40,  # never over its cap at busy 0.2: a turn's wait must not hold back its growth
        memory_mib=1024,
        busy=0.2,
        workload_mib=800,
        extra=("--grow-to-mib", "1500", "--grow-after", "2"),
    )

    small_at: list[float] = []  # when the GPU last showed it at 800 MiB: it grew after that

    def grown_or_gone() -> bool:
        rows = [c for g in rig.truth()["gpus"] for c in g["contexts"] if c["pid"] == grower.pid]
        if rows and rows[0]["memory_bytes"] == 800 << 20:
            small_at.append(time.monotonic())
            return False
        # Gone: killed between two readings (the guard can be quicker than this poll).
        return not rows or rows[0]["memory_bytes"] == 1500 << 20

    wait_for(grown_or_gone, 10, "the workload grown to 1500 MiB")
    assert small_at, "never seen at its first 800 MiB"
    wait_for(lambda: grower.proc.poll() is not None, 1.0, "the grower killed")
    assert time.monotonic() - small_at[-1] <= 1.1  # growth to kill, plus one reading at most
    assert grower.proc.returncode == -signal.SIGKILL
    assert neighbour.proc.poll() is None
    events = wait_for(
        lambda: [e for e in rig.api.events() if e.get("reason") == "GPUMemoryQuotaExceeded"],
        5,
        "the Event",
    )
    assert events[0]["involvedObject"]["name"] == "grower"
    assert "1024 MiB" in events[0]["message"]


def test_a_frozen_burn_keeps_the_gpu_busy_until_its_queue_drains(rig: EnforcedNode) -> None:
    """The physics the freezer is up against: work already queued runs on (here a burn's
    queue of 1024 x 2 ms kernels, frozen by hand through the real cgroup freezer)."""
    box = rig.run_pod(
        "burner", 30, annotations={POLICY: "best-effort"}, extra=("--pattern", "burn", "--kernel-ms", "2")
    )
    time.sleep(1.0)
    freeze = box.cgroup / "cgroup.freeze"
    freeze.write_text("1")
    try:
        wait_for(lambda: frozen(box.cgroup), 2, "the burner frozen")
        time.sleep(0.3)  # a launch it was blocked in lands as room appears
        (at_freeze,) = [c for g in rig.truth()["gpus"] for c in g["contexts"] if c["pid"] == box.pid]
        assert at_freeze["pending_s"] >= 1.5
        (used,) = rig.utilization([box], at_freeze["pending_s"] - 0.3)
        assert used >= 95, f"frozen, its queued work runs at {used:.0f}%"
        time.sleep(0.6)
        (after,) = [c for g in rig.truth()["gpus"] for c in g["contexts"] if c["pid"] == box.pid]
        assert after["ran_s"] - at_freeze["ran_s"] == pytest.approx(at_freeze["pending_s"], abs=1e-6)
        (idle,) = rig.utilization([box], 0.5)
        assert idle == 0.0
    finally:
        freeze.write_text("0")


def test_sigterm_thaws_everything_before_the_agent_exits(rig: EnforcedNode) -> None:
    boxes = [rig.run_pod(f"held-{i}", 20) for i in range(2)]
    wait_for(lambda: any(frozen(b.cgroup) for b in boxes), 5, "a container frozen by the duty cycle")
    assert rig.stop_agent(signal.SIGTERM) == 0
    assert not any(frozen(b.cgroup) for b in boxes)  # at exit, not "soon after": no watchdog involved
    journal = json.loads((rig.state_dir / "frozen.json").read_text())
    assert (journal["cgroups"], journal["processes"]) == ([], [])


def test_legacy_metrics_serve_gpu_managers_names(short_dir: Path) -> None:
    real_layout()
    args = ("--device-guard", "off", "--no-ioctl-tracing", "--legacy-metrics")
    with enforced_node(short_dir, agent_args=args) as node:
        node.run_pod("migrated", 30, memory_mib=2048)
        text = wait_for(lambda: legacy_scrape(node), 10, "the legacy series")
    labels = 'container_name="c",gpu="0",namespace="default",node="sim-node",pod_name="migrated"'
    assert f"container_request_gpu_memory{{{labels}}} 2048.0" in text
    assert f"container_request_gpu_utilization{{{labels}}} 30.0" in text
    assert f"container_gpu_utilization{{{labels}}}" in text


def legacy_scrape(node: EnforcedNode) -> str | None:
    """The scrape once the first utilization sample is in (requests show up before it)."""
    text = node.metrics()
    return text if "container_request_gpu_memory{" in text and "container_gpu_utilization{" in text else None
