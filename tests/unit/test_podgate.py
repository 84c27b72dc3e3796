"""The device gate on a directory tree laid out like kubepods, with real inotify: a pod's
cgroup gets its policy the moment it appears (not at the next pass), again when a container
cgroup appears in it, and none while the pod is exempt or not decidable yet."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.control.deviceguard import TargetsNotReadyError
from agent.control.podgate import PodGate
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, NvidiaMajors, Outcome
from agent.platform.cgroups.layout import UNIFIED, CgroupLayout, CgroupMode
from agent.platform.cgroups.paths import CgroupResolver

UID = "0a1b2c3d-0000-4000-8000-00000000000a"
CONTAINER = "c" * 64


class RecordingRules:
    """A DeviceRules that records what it was asked (the kernel side is tests/runtime)."""

    controller = UNIFIED

    def __init__(self) -> None:
        self.ensured: list[tuple[Path, DevicePolicy, float]] = []
        self.removed: list[Path] = []

    def set_majors(self, majors: NvidiaMajors) -> None: ...

    def ensure(self, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        self.ensured.append((cgroup_dir, policy, time.monotonic()))
        return Outcome.APPLIED

    def planned(self, cgroup_dir: Path, policy: DevicePolicy) -> list[str]:
        return []

    def remove(self, cgroup_dir: Path) -> None:
        self.removed.append(cgroup_dir)

    def denied(self, cgroup_dir: Path) -> int | None:
        return None

    def close(self) -> None: ...


def wait_for(check: Callable[[], object], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def kubepods(tmp_path: Path) -> Path:
    (tmp_path / "kubepods" / "besteffort").mkdir(parents=True)  # burstable appears later
    return tmp_path / "kubepods"


@contextmanager
def running(gate: PodGate) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=gate.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert gate.watching.wait(5)
        yield
    finally:
        stop.set()
        thread.join(5)


def make_gate(
    kubepods: Path, rules: RecordingRules, verdict: Callable[[str], DevicePolicy | None]
) -> PodGate:
    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=kubepods.parent), CgroupDriver.CGROUPFS)
    # A pass every 60 s: whatever happens within the test happened on an inotify event.
    return PodGate(verdict, resolver, rules, interval_s=60, proc_root=kubepods.parent)


def test_a_new_pod_cgroup_is_gated_at_once_and_again_when_a_container_appears(kubepods: Path) -> None:
    rules = RecordingRules()
    policies: dict[str, DevicePolicy | None] = {UID: DevicePolicy(None)}
    with running(make_gate(kubepods, rules, policies.__getitem__)):
        pod = kubepods / "besteffort" / f"pod{UID}"
        made = time.monotonic()
        pod.mkdir()
        wait_for(lambda: rules.ensured)
        assert rules.ensured[0][:2] == (pod, DevicePolicy(None))
        assert rules.ensured[0][2] - made < 1.0
        policies[UID] = DevicePolicy(frozenset({1}))  # a DRA claim prepared before the container
        (pod / CONTAINER).mkdir()
        wait_for(lambda: len(rules.ensured) == 2)
        assert rules.ensured[1][:2] == (pod, DevicePolicy(frozenset({1})))
        (pod / CONTAINER / "container").mkdir()  # deeper: not the pod's business
        (kubepods / "besteffort" / "not-a-pod").mkdir()
        time.sleep(0.2)
        assert len(rules.ensured) == 2


def test_a_qos_parent_made_later_is_watched_too(kubepods: Path) -> None:
    rules = RecordingRules()
    with running(make_gate(kubepods, rules, lambda uid: DevicePolicy(None))):
        (kubepods / "burstable").mkdir()
        time.sleep(0.1)  # the watch on the new parent goes in place
        (kubepods / "burstable" / f"pod{UID}").mkdir()
        wait_for(lambda: rules.ensured)
        assert rules.ensured[0][0] == kubepods / "burstable" / f"pod{UID}"


def test_exempt_and_undecidable_pods_get_nothing_and_a_pass_catches_up(kubepods: Path) -> None:
    rules = RecordingRules()
    state = {"synced": False, "exempt": False}

    def verdict(uid: str) -> DevicePolicy | None:
        if not state["synced"]:
            raise TargetsNotReadyError("not synced")
        return None if state["exempt"] else DevicePolicy(None)

    gate = make_gate(kubepods, rules, verdict)
    with running(gate):
        pod = kubepods / f"pod{UID}"  # a Guaranteed pod, right in kubepods
        pod.mkdir()
        time.sleep(0.2)
        assert rules.ensured == []
    state["synced"] = True
    gate.reconcile_once()  # the periodic pass
    assert [p for p, _, _ in rules.ensured] == [pod]
    state["exempt"] = True
    gate.reconcile_once()
    assert rules.removed == [pod] and gate.stats().gated == 0
    state["exempt"] = False
    gate.reconcile_once()
    pod.rmdir()
    gate.reconcile_once()  # gone: forgotten, and what the mechanism held for it dropped
    assert rules.removed == [pod, pod] and gate.stats().gated == 0


def test_a_pod_made_before_the_pod_cache_synced_is_gated_at_once_and_released_if_exempt(
    kubepods: Path,
) -> None:
    # The agent's first instant (a DaemonSet rollout restarts it while pods start): the
    # verdict fails closed until exemptions can be told, and the gate judges the pods it
    # gated meanwhile again as soon as they can, not at the next pass (60 s here).
    rules = RecordingRules()
    state = {"settled": False}

    def verdict(uid: str) -> DevicePolicy | None:
        return None if state["settled"] else DevicePolicy(None)  # exempt, once that can be told

    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=kubepods.parent), CgroupDriver.CGROUPFS)
    gate = PodGate(
        verdict, resolver, rules, interval_s=60, proc_root=kubepods.parent, settled=lambda: state["settled"]
    )
    with running(gate):
        pod = kubepods / "besteffort" / f"pod{UID}"
        made = time.monotonic()
        pod.mkdir()
        wait_for(lambda: rules.ensured)
        assert rules.ensured[0][:2] == (pod, DevicePolicy(None)) and rules.ensured[0][2] - made < 1.0
        state["settled"] = True
        wait_for(lambda: rules.removed == [pod])
        assert gate.stats().gated == 0
