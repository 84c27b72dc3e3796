"""DeviceGuard's reconcile logic over a fake cgroup tree, with a recording rule mechanism
(the real mechanisms run against the kernel in tests/integration/test_device_guard.py)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from agent.clock import VirtualClock
from agent.control.deviceguard import DeviceGuard, GuardTarget, TargetsNotReadyError, default_rules
from agent.errors import PlatformError
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, GuardError, NvidiaMajors, Outcome
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.layout import UNIFIED, CgroupLayout, CgroupMode
from agent.platform.cgroups.paths import CgroupResolver
from agent.settings import GuardMode

UID_A = "aaaaaaaa-0000-0000-0000-000000000001"
UID_B = "bbbbbbbb-0000-0000-0000-000000000002"
CID_1 = "1" * 64
CID_2 = "2" * 64
CID_3 = "3" * 64


class RecordingRules:
    """A DeviceRules that remembers what it was asked; ``undone`` simulates a runtime update."""

    controller = UNIFIED

    def __init__(self) -> None:
        self.in_place: dict[Path, tuple[DevicePolicy, bool]] = {}
        self.undone: set[Path] = set()
        self.failing: dict[Path, str] = {}
        self.calls: list[tuple[str, Path]] = []
        self.majors: list[NvidiaMajors] = []
        self.closed = False

    def set_majors(self, majors: NvidiaMajors) -> None:
        self.majors.append(majors)

    def ensure(self, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        self.calls.append(("ensure", cgroup_dir))
        if cgroup_dir in self.failing:
            raise GuardError(self.failing[cgroup_dir])
        if not cgroup_dir.is_dir():  # as both mechanisms: nothing to open or write
            raise GuardError(f"cannot open cgroup {cgroup_dir}: No such file or directory")
        known = cgroup_dir in self.in_place
        self.in_place[cgroup_dir] = (policy, audit)
        if not known:
            return Outcome.APPLIED
        if cgroup_dir in self.undone:
            self.undone.discard(cgroup_dir)
            return Outcome.REPAIRED
        return Outcome.UNCHANGED

    def planned(self, cgroup_dir: Path, policy: DevicePolicy) -> list[str]:
        return [f"would limit {cgroup_dir.name}"]

    def remove(self, cgroup_dir: Path) -> None:
        self.calls.append(("remove", cgroup_dir))
        self.in_place.pop(cgroup_dir, None)

    def denied(self, cgroup_dir: Path) -> int | None:
        return 7 if cgroup_dir in self.in_place else None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text("Character devices:\n510 nvidia-uvm\n\nBlock devices:\n")
    return tmp_path


def scope(root: Path, uid: str, cid: str, qos: str = "burstable") -> Path:
    path = root / "cg" / "kubepods" / qos / f"pod{uid}" / cid
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_guard(
    root: Path, targets: list[GuardTarget], rules: RecordingRules, mode: GuardMode = GuardMode.ENFORCE
) -> DeviceGuard:
    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=root / "cg"), CgroupDriver.CGROUPFS)
    return DeviceGuard(
        lambda: list(targets), resolver, rules, mode=mode, clock=VirtualClock(), proc_root=root / "proc"
    )


def target(uid: str, cid: str, minors: frozenset[int] | None, name: str) -> GuardTarget:
    return GuardTarget(uid, "Burstable", f"containerd://{cid}", minors, f"ns/{name}/main")


def test_apply_verify_repair_remove(tree: Path) -> None:
    rules = RecordingRules()
    a1 = target(UID_A, CID_1, frozenset({1}), "a")
    b2 = target(UID_B, CID_2, None, "b")
    targets = [a1, b2]
    guard = make_guard(tree, targets, rules)

    report = guard.reconcile_once()
    assert report.pending == ["ns/a/main", "ns/b/main"] and not report.applied

    scope_a, scope_b = scope(tree, UID_A, CID_1), scope(tree, UID_B, CID_2)
    report = guard.reconcile_once()
    assert report.applied == ["ns/a/main", "ns/b/main"] and not report.pending
    assert rules.in_place == {
        scope_a: (DevicePolicy(frozenset({1})), False),
        scope_b: (DevicePolicy(None), False),
    }
    assert rules.majors[-1] == NvidiaMajors(uvm=frozenset({510}))

    report = guard.reconcile_once()
    assert report.unchanged == 2 and not report.applied and not report.reattached

    rules.undone.add(scope_a)  # a runtime update detached our program
    report = guard.reconcile_once()
    assert report.reattached == ["ns/a/main"] and report.unchanged == 1

    targets.remove(b2)  # the pod went (from the ledger's point of view)
    report = guard.reconcile_once()
    assert report.removed == ["ns/b/main"]
    assert ("remove", scope_b) in rules.calls and scope_b not in rules.in_place

    stats = guard.stats()
    assert (stats.guarded, stats.reattachments, stats.errors, stats.passes) == (1, 1, 0, 5)
    assert stats.denied == {"ns/a/main": 7}
    assert stats.mechanism == "cgroup v2 bpf"


def test_a_container_whose_cgroup_went_becomes_pending(tree: Path) -> None:
    rules = RecordingRules()
    guard = make_guard(tree, [target(UID_A, CID_1, frozenset({0}), "a")], rules)
    path = scope(tree, UID_A, CID_1)
    assert guard.reconcile_once().applied == ["ns/a/main"]
    path.rmdir()
    report = guard.reconcile_once()
    assert report.pending == ["ns/a/main"] and not report.errors
    assert ("remove", path) in rules.calls
    assert guard.stats().guarded == 0


def test_one_failing_container_does_not_stop_the_others_and_is_logged_once(
    tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rules = RecordingRules()
    targets = [target(UID_A, CID_1, frozenset({0}), "a"), target(UID_A, CID_2, frozenset({0}), "a2")]
    guard = make_guard(tree, targets, rules)
    bad, good = scope(tree, UID_A, CID_1), scope(tree, UID_A, CID_2)
    rules.failing[bad] = "cannot open devices.deny: Permission denied"
    with caplog.at_level(logging.INFO, logger="agent.control.deviceguard"):
        for _ in range(3):
            report = guard.reconcile_once()
            assert report.errors == ["device guard: ns/a/main: cannot open devices.deny: Permission denied"]
        assert good in rules.in_place
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        del rules.failing[bad]
        assert guard.reconcile_once().applied == ["ns/a/main"]
        assert any("problem with ns/a/main is resolved" in r.getMessage() for r in caplog.records)
    assert guard.stats().errors == 3


def test_a_failing_target_source_keeps_every_rule(tree: Path) -> None:
    rules = RecordingRules()
    path = scope(tree, UID_A, CID_1)
    fail = threading.Event()

    def targets() -> list[GuardTarget]:
        if fail.is_set():
            raise PlatformError("pod-resources API unreachable")
        return [target(UID_A, CID_1, frozenset({0}), "a")]

    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=tree / "cg"), CgroupDriver.CGROUPFS)
    guard = DeviceGuard(targets, resolver, rules, proc_root=tree / "proc")
    guard.reconcile_once()
    fail.set()
    report = guard.reconcile_once()
    assert report.errors == ["device guard pass skipped: pod-resources API unreachable"]
    assert path in rules.in_place and not report.removed


def test_audit_mode_asks_for_audit_and_logs_the_plan(tree: Path, caplog: pytest.LogCaptureFixture) -> None:
    rules = RecordingRules()
    guard = make_guard(tree, [target(UID_A, CID_1, None, "a")], rules, mode=GuardMode.AUDIT)
    path = scope(tree, UID_A, CID_1)
    with caplog.at_level(logging.INFO, logger="agent.control.deviceguard"):
        guard.reconcile_once()
    assert rules.in_place[path] == (DevicePolicy(None), True)
    assert f"would limit {CID_1}" in caplog.text


def test_off_mode_touches_nothing(tree: Path) -> None:
    rules = RecordingRules()
    scope(tree, UID_A, CID_1)
    guard = make_guard(tree, [target(UID_A, CID_1, None, "a")], rules, mode=GuardMode.OFF)
    assert guard.reconcile_once().applied == []
    assert rules.calls == [] and guard.stats().mechanism == "none"


def test_bad_gpu_minor_is_an_error_for_that_container(tree: Path) -> None:
    rules = RecordingRules()
    scope(tree, UID_A, CID_1)
    guard = make_guard(tree, [target(UID_A, CID_1, frozenset({300}), "a")], rules)
    assert "GPU minor numbers must be 0..247" in guard.reconcile_once().errors[0]


def test_run_loops_on_the_clock_until_stopped(tree: Path) -> None:
    rules = RecordingRules()
    scope(tree, UID_A, CID_1)
    stop = threading.Event()
    clock = VirtualClock()
    passes = 0

    def stop_after_five() -> list[GuardTarget]:
        nonlocal passes
        passes += 1
        if passes == 5:
            stop.set()
        return [target(UID_A, CID_1, None, "a")]

    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=tree / "cg"), CgroupDriver.CGROUPFS)
    guard = DeviceGuard(
        stop_after_five, resolver, rules, interval_s=3.0, clock=clock, proc_root=tree / "proc"
    )
    start = clock.monotonic()
    guard.run(stop)
    assert passes == 5 and guard.stats().passes == 5
    assert clock.monotonic() - start == pytest.approx(4 * 3.0)


def test_close_keeps_rules_unless_asked(tree: Path) -> None:
    rules = RecordingRules()
    path = scope(tree, UID_A, CID_1)
    guard = make_guard(tree, [target(UID_A, CID_1, None, "a")], rules)
    guard.reconcile_once()
    guard.close()
    assert path in rules.in_place and rules.closed
    guard.close(remove_rules=True)
    assert path not in rules.in_place


def test_default_rules_follow_the_layout(tmp_path: Path) -> None:
    hybrid = CgroupLayout(CgroupMode.HYBRID, tmp_path / "unified", {"devices": tmp_path / "devices"})
    assert isinstance(default_rules(hybrid), V1DeviceRules)
    assert isinstance(default_rules(CgroupLayout(CgroupMode.V2, tmp_path)), BpfDeviceRules)


def test_targets_not_ready_at_start_up_skip_the_pass_without_an_error(tree: Path) -> None:
    rules = RecordingRules()
    path = scope(tree, UID_A, CID_1)
    ready = threading.Event()

    def targets() -> list[GuardTarget]:
        if not ready.is_set():
            raise TargetsNotReadyError("the pod cache has not synced yet")
        return [target(UID_A, CID_1, frozenset({0}), "a")]

    resolver = CgroupResolver(CgroupLayout(CgroupMode.V2, v2_root=tree / "cg"), CgroupDriver.CGROUPFS)
    guard = DeviceGuard(targets, resolver, rules, proc_root=tree / "proc")
    report = guard.reconcile_once()
    assert report.errors == [] and path not in rules.in_place
    ready.set()
    guard.reconcile_once()
    assert path in rules.in_place
    assert guard.stats().errors == 0


def test_a_guarded_container_is_verified_where_it_was_found_without_resolving_its_cgroup_again(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rules = RecordingRules()
    targets = [target(UID_A, CID_1, frozenset({0}), "a")]
    guard = make_guard(tree, targets, rules)
    path = scope(tree, UID_A, CID_1)
    resolved: list[str] = []
    original = CgroupResolver.container_dirs

    def counting(self: CgroupResolver, *args: object, **kwargs: object) -> object:
        resolved.append(str(args[0]))
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CgroupResolver, "container_dirs", counting)
    assert guard.reconcile_once().applied == ["ns/a/main"] and len(resolved) == 1
    rules.undone.add(path)  # a runtime update undid the rules: still repaired on the next pass
    assert guard.reconcile_once().reattached == ["ns/a/main"]
    assert guard.reconcile_once().unchanged == 1 and len(resolved) == 1
    # A changed target (its GPUs) is resolved afresh; so is one whose cgroup went.
    targets[0] = target(UID_A, CID_1, frozenset({1}), "a")
    assert guard.reconcile_once().unchanged == 1 and len(resolved) == 2
    assert rules.in_place[path] == (DevicePolicy(frozenset({1})), False)
    path.rmdir()
    assert guard.reconcile_once().pending == ["ns/a/main"] and len(resolved) == 3
