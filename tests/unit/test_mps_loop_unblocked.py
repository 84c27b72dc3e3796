"""No MPS work stalls the control loop: while an Allocate waits for a daemon that is slow to
come up, a tick stops a daemon that is slow to stop, and a v3 command hangs, all at once and
each for up to HOLD_S, the enforcer runs real periods (real time, a simulated GPU) that read
the sharing layer's published view, on time, and keeps freezing and thawing."""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.clock import SystemClock, VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.control.mpsgrants import MpsGrant, save_grants
from agent.control.mpssharing import MpsSharing
from agent.domain.ledger import Assignment
from agent.domain.requests import ResolvedRequest
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.mpspartition import partition_for
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program
from agent.platform.mpsdaemon import DaemonState, MpsDaemon
from agent.platform.mpsv3 import MpsCapability, namespace_name
from agent.settings import SharingMode, SharingSettings
from tests.unit.enforcer_plant import PERIOD, spec

HOLD_S = 10.0  # how long each held call blocks at most (it returns early once released)
GPUS = tuple(
    GpuInfo(i, f"GPU-{i}{i}{i}{i}0000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", 81559, i, "", 0)
    for i in range(3)
)
HELD_PERIODS = 12  # periods (3 s) the loop must run while all three calls are held
MAX_WORK_S = PERIOD  # a period's work is milliseconds; blocked on the sharing layer it was seconds
MAX_GAP_S = 4 * PERIOD  # between period starts: 0.25 s on time; a stalled loop waits HOLD_S


class RealTime(VirtualClock):
    """The real clock behind the interface the simulated GPU node reads."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        return SystemClock().sleep(seconds, stop)


class HeldDaemon(MpsDaemon):
    """A GPU's daemon (no process) whose wait_ready and stop block until ``release``."""

    def __init__(self, gpu: GpuInfo, root: Path, release: threading.Event, *, running: bool) -> None:
        super().__init__(gpu.index, gpu.uuid, ["held"], root)
        self.release = release
        self.entered = threading.Event()
        self.state = DaemonState.RUNNING if running else DaemonState.STOPPED

    def ensure(self, now: float) -> DaemonState:
        return self.state

    def wait_ready(self, timeout_s: float) -> bool:
        self.entered.set()
        self.release.wait(HOLD_S)
        self.state = DaemonState.RUNNING
        return True

    def stop(self) -> None:
        self.entered.set()
        self.release.wait(HOLD_S)
        self.state = DaemonState.STOPPED


class HeldCommands:
    """The v3 control command: answers at once, except a namespace opened to 100 % (a share
    that lost trust), which hangs until ``release``."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.entered = threading.Event()
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        if "--active-thread-percentage=100" in argv:
            self.entered.set()
            self.release.wait(HOLD_S)
        return subprocess.CompletedProcess(argv, 0, "", "")


class TimedEnforcer(Enforcer):
    """The enforcer, telling when each period started and how long its work took."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timings: list[tuple[float, float]] = []  # (start, work seconds)
        self.ticked = threading.Condition()

    def period(self, stop: threading.Event | None = None, start: float | None = None) -> None:
        began = time.monotonic()
        super().period(stop, start)
        with self.ticked:
            self.timings.append((began, self.stats.last_period_s))
            self.ticked.notify_all()

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
        with self.ticked:
            assert self.ticked.wait_for(predicate, timeout_s), f"{what}: not within {timeout_s:.1f} s"


def started(target: Callable[[], object], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def test_the_control_loop_runs_on_time_while_daemon_calls_and_v3_commands_hang(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    key = "uid-a/c"  # the share the loop holds, granted before (grants.json) on GPU 0
    granted = MpsGrant(
        0, partition_for(30, 132), None, root / "p", root / "l", False, namespace_name("uid-a", "c")
    )
    assert save_grants(root / "grants.json", {key: granted}) is None
    release = threading.Event()
    commands = HeldCommands(release)
    shares = {0: 1, 1: 1, 2: 0}
    sharing = MpsSharing(
        SharingSettings(mode=SharingMode.MPS, mps_root=root, ready_timeout_s=HOLD_S, idle_stop_s=0.0),
        gpus=GPUS,
        command=[os.path.realpath("/bin/sh")],
        mode=lambda: SharingMode.MPS,
        shares_on=shares.__getitem__,
        capability=MpsCapability(True, "test", {}),
        run_command=commands,
    )
    daemons = [HeldDaemon(g, root, release, running=g.index != 1) for g in GPUS]
    for daemon in daemons:
        sharing._daemons[daemon.gpu] = daemon
    # Not trusted yet (no reading of its uids): on GPU 0, MPS clients run concurrently, and the
    # freezer holds this one blind (NVML credits its work to the MPS server) to its grant.
    assert sharing.concurrent(0) and sharing.blind_share("uid-a", "c") == granted.partition.effective_percent

    clock = RealTime()
    gpu = VirtualGpuNode(clock, [EngineConfig()])
    gpu.add("a", 0, pattern_program(PatternSpec("train"), WorkloadStats()))
    enforcer = TimedEnforcer(
        gpus=[0],
        samples=gpu,
        specs=lambda: [spec("a", 30)],
        owner_of=lambda _pid: None,  # no sample is the container's: it is held blind
        locate=lambda s: ThrottleTarget(s.container_id, None, None),
        actuator=gpu,
        period_s=PERIOD,
        concurrent=sharing.concurrent,
        untrusted=lambda s: sharing.blind_share(s.pod_uid, s.container),
        clock=SystemClock(),
    )
    freezes = gpu.containers["a"].freezes
    stop = threading.Event()
    loop = started(lambda: enforcer.run(stop), "enforcer")
    held: list[threading.Thread] = []
    grants: list[MpsGrant | None] = []
    try:
        enforcer.wait_for("a first freeze", lambda: any(frozen for _t, frozen in freezes), HOLD_S)

        # An Allocate on GPU 1 waits for its daemon; a tick stops GPU 2's idle daemon; a
        # trust reading finds the share on GPU 0 running as the daemon's uid and opens its
        # namespace: each hangs, at once.
        tenant = Assignment("uid-b", "default", "b", "c", False, (1,), 30, 1024)
        held.append(
            started(
                lambda: grants.append(sharing.grant_for(ResolvedRequest(30, (GPUS[1],)), tenant)), "allocate"
            )
        )
        assert daemons[1].entered.wait(HOLD_S), "the Allocate never reached its daemon"
        held.append(started(sharing.tick, "mps-tick"))
        assert daemons[2].entered.wait(HOLD_S), "the tick never reached the idle daemon"
        sharing.uids_of = lambda _pod, _container: frozenset({os.geteuid()})
        held.append(started(sharing.check_users, "mps-trust"))
        assert commands.entered.wait(HOLD_S), "the trust reading never reached its v3 command"
        first_held = time.monotonic()

        def during() -> tuple[list[tuple[float, float]], int, int]:
            timings = [t for t in enforcer.timings if t[0] >= first_held]
            changes = [frozen for t, frozen in list(freezes) if t >= first_held]
            return timings, sum(changes), len(changes) - sum(changes)

        def enough() -> bool:
            timings, frozen, thawed = during()
            return len(timings) >= HELD_PERIODS and frozen >= 2 and thawed >= 2

        enforcer.wait_for("periods, freezes and thaws while held", enough, HOLD_S - 1.0)
        assert all(t.is_alive() for t in held), "a held call returned early: the test proves nothing"
        timings, frozen, thawed = during()
        starts = [s for s, _w in list(enforcer.timings)]
        gaps = [b - a for a, b in itertools.pairwise(starts) if b >= first_held]
        work = max(w for _s, w in timings)
        detail = (
            f"work {work:.3f} s, gaps {max(gaps):.3f} s, {frozen} freezes, {thawed} thaws, {enforcer.stats}"
        )
        assert work < MAX_WORK_S, detail
        assert max(gaps) < MAX_GAP_S, detail
        assert not enforcer.uses_turns(0) and enforcer.controls()[0].held_blind  # read the view
    finally:
        release.set()
        for thread in held:
            thread.join(HOLD_S)
        stop.set()
        loop.join(HOLD_S)
    assert not loop.is_alive() and not any(t.is_alive() for t in held)
    assert not gpu.frozen("a")  # the loop's end thawed it
    # The held calls finished their work once released.
    assert len(grants) == 1 and grants[0] is not None and grants[0].namespace == namespace_name("uid-b", "c")
    assert sharing.concurrent(1) and daemons[2].state is DaemonState.STOPPED
    assert "runs as uid" in (sharing.untrusted("uid-a", "c") or "")
    assert any("--active-thread-percentage=100" in argv for argv in commands.calls)
