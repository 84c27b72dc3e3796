"""``bench/enforcement.py --model``: one scenario in virtual time, in this process.

The GPU engine and the workloads' programs (``agent.emulators.virtualgpu``) with the
agent's own ``Enforcer`` on a ``VirtualClock``: every control period runs as the agent runs
it (measure from NVML-style samples, set duties, thaw and freeze at the cycle's edges), and
the engine executes what each program queued, frozen or not.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.control.enforcer import Enforcer
from agent.control.mpsgrants import mps_ceiling
from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.mpspartition import effective_share, partition_for
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.mpscontrol import MpsControl
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

PERIOD_S = 0.25
MPS_SERVER_PID = 999  # stands for the MPS server's process (not a container's)
H100_SMS = 132


@dataclass(frozen=True)
class Box:
    """One container of a scenario."""

    name: str
    cores: int
    policy: str
    cheat: bool = False  # sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 in its own env


@dataclass
class Run:
    """What one scenario measured: per container, its use per window and its report."""

    windows: list[list[float]]  # percent of the GPU, per window
    starts: list[float]  # the windows' start times (the phases' clock)
    reports: list[dict[str, object]] = field(default_factory=list)


def box_spec(box: Box) -> EnforcementSpec:
    return EnforcementSpec(
        pod_uid=f"uid-{box.name}",
        namespace="default",
        pod=f"pod-{box.name}",
        container="c",
        container_id=f"cid-{box.name}",
        runtime="containerd",
        qos_class="Burstable",
        gpus=(0,),
        cores=box.cores,
        cap=box.cores,
        memory_quota_mib=1024,
        policy=Policy(box.policy),
        limit_set=False,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        timeslice_s=args.timeslice_ms / 1000,
        sample_delay_s=args.sample_delay,
        sample_jitter_s=args.sample_jitter,
        mps_samples=args.mps_samples,
        seed=args.seed,
    )
    if args.sample_period is not None:
        config = EngineConfig(**{**config.__dict__, "sample_period_s": args.sample_period})
    return config


def model_enforcer(
    gpu: VirtualGpuNode, specs: Callable[[], list[EnforcementSpec]], clock: VirtualClock, **options: Any
) -> Enforcer:
    """The agent's own controller on the virtual GPU node, as the agent builds it (each
    container's cgroup stands for itself); ``options``: Enforcer's keyword arguments."""
    return Enforcer(
        gpus=[0],
        samples=gpu,
        specs=specs,
        owner_of=gpu.owner_of,
        locate=lambda s: ThrottleTarget(s.container_id, None, None),
        actuator=gpu,
        period_s=PERIOD_S,
        clock=clock,
        **options,
    )


def v3_percentage(control: MpsControl, box: Box, percent: int, pid: int) -> float:
    """What an MPS v3 daemon gives ``box``: a namespace at ``percent`` bound to its cgroup,
    its own env (100 for the cheat) only lowering it, as the agent sets it up
    (agent.control.mpsnamespacing)."""
    name, cgroup = f"vcuda-{box.name}", f"/sys/fs/cgroup/kubepods/pod-{box.name}"
    for line in (
        f"namespace create --name={name}",
        f"namespace set --name={name} --active-thread-percentage={percent}",
        f"namespace bind --name={name} --cgroup={cgroup}",
    ):
        reply = control.command(line)
        assert reply == "", reply
    limits = control.admit(pid, 0, 100.0 if box.cheat else float(percent), None, cgroup)
    assert limits is not None
    return limits.percentage


def continuous_shares(boxes: list[Box]) -> list[float]:
    """Each container's share if it were delivered continuously (a GPU partitioned exactly):
    its request, and the best-effort ones what is left."""
    if len(boxes) == 1 and boxes[0].policy == "burst-share":
        return [1.0]  # alone: its limit, the whole GPU
    held = [b.cores / 100 if b.policy != "best-effort" else 0.0 for b in boxes]
    left = max(0.0, 1.0 - sum(held))
    free = [b for b in boxes if b.policy == "best-effort"]
    return [h if b.policy != "best-effort" else left / len(free) for b, h in zip(boxes, held, strict=True)]


def run_model(
    boxes: list[Box],
    spec: PatternSpec,
    args: argparse.Namespace,
    window_s: float,
    *,
    continuous: bool = False,
) -> Run:
    """``continuous``: no agent; each container gets its share of the GPU continuously
    (the engine's MPS partitioning at :func:`continuous_shares`), the ideal a cap is
    compared with."""
    clock = VirtualClock()
    gpu = VirtualGpuNode(clock, [engine_config(args)])
    specs = [box_spec(b) for b in boxes]
    # The engine can always run MPS; the product uses its limits only where it may (they are
    # advisory on every driver: agent.control.mpssharing), else the freezer holds the shares.
    # With an MPS v3 driver (--driver-mps-v3) the limits are the daemon's, per cgroup: used for
    # pods whose spec proves non-root (--pods-claim-non-root; here they run as uids 1000+n);
    # the others get no MPS grant at Allocate and are time-sliced under the freezer.
    v3 = args.actuator in ("mps", "auto") and getattr(args, "driver_mps_v3", False)
    v3 = v3 and getattr(args, "pods_claim_non_root", False)
    mps = continuous or (args.actuator in ("mps", "auto") and (args.mps_advisory_limits or v3))
    control = MpsControl(MPS_SERVER_PID, protocol=3) if v3 and not continuous else None
    enforcer = model_enforcer(
        gpu,
        lambda: specs,
        clock,
        enabled=not continuous,
        concurrent=lambda _gpu: mps,  # MPS clients run at once: duty cycles, not turns
    )
    stats = [WorkloadStats() for _ in boxes]
    if mps:
        gpu.node.engines[0].attach_mps_server(MPS_SERVER_PID, clock.monotonic())
    ideal = continuous_shares(boxes)
    for n, (box, box_spec_, box_stats) in enumerate(zip(boxes, specs, stats, strict=True)):
        # What Allocate hands out: the ceiling's whole TPCs (agent.control.mpssharing), which
        # a cheat replaces with 100 in its own env (the daemon's default of 100 lets it).
        fixed_others = sum(b.cap or 0 for b in specs if b is not box_spec_ and b.policy is Policy.FIXED_SHARE)
        ceiling = mps_ceiling(box_spec_, fixed_others)
        percent = partition_for(ceiling, H100_SMS).percent
        share = 1.0 if box.cheat else effective_share(percent, H100_SMS)
        if control is not None:  # the engine's v3 daemon: its namespace, whatever the env says
            share = effective_share(v3_percentage(control, box, percent, 1000 + n), H100_SMS)
        if continuous:
            share = ideal[n]
        gpu.add(box.name, 0, pattern_program(spec, box_stats), share=share if mps else 1.0, mps_client=mps)
    start = clock.monotonic()
    windows: list[list[float]] = [[] for _ in boxes]
    starts: list[float] = []
    last = [0.0] * len(boxes)
    periods_per_window = round(window_s / PERIOD_S)
    index = 0
    while clock.monotonic() - start < args.seconds - 1e-9:
        window_start = clock.monotonic()
        for _ in range(periods_per_window):
            enforcer.period()
            index += 1
            clock.sleep(start + index * PERIOD_S - clock.monotonic())
        ran = [gpu.gpu_seconds(b.name) for b in boxes]
        for i in range(len(boxes)):
            windows[i].append(100 * (ran[i] - last[i]) / (clock.monotonic() - window_start))
        starts.append(window_start)
        last = ran
    enforcer.release_all()
    reports: list[dict[str, object]] = []
    for box_stats in stats:
        p99 = box_stats.latency(0.99, since=start + args.settle)  # as the error: after settling
        reports.append({"phases": box_stats.phases, "latency_p99_ms": None if p99 is None else p99 * 1000})
    return Run(windows, starts, reports)
