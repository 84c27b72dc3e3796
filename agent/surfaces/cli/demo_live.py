"""The demo's live act: a simulated 2-GPU node whose pods run as real processes in real
container cgroups (``agent.emulators.enforcednode``) on the simulated GPUs' engine, with a
table refreshed every second that shows each pod's use against its cap (as the agent
measures it from late NVML samples, and as the GPU really ran it), its memory against its
quota, the duty cycle the agent holds it to and the agent's last action on it.

The story: GPU 0 is shared by the example pod ``cuda-share-50`` (a training loop capped at
50 %), a fixed-share 30 pod running CUDA graphs, a best-effort inference server and a pod
that grows past its memory quota and is killed; GPU 1 runs a burst-share pod alone (it
borrows the idle GPU) until a fixed-share neighbour arrives and it is brought back to its
request. GPU 2 is served through DRA: a claim for 30 cores and 4 GiB is published, allocated,
prepared and held at 30 % (demo_dra.py). GPU 3 is in MIG mode: a pod on its 2g.20gb instance
keeps its throughput when a neighbour queues deep work on the 3g.40gb one (demo_mig.py). An
ignored XID 13 shows in the metrics. Then the agent is SIGKILLed while it throttles and the
watchdog thaws every container."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from agent.domain.annotations import CORE_LIMIT, POLICY
from agent.emulators.containers import RunningContainer
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen, wait_for
from agent.errors import VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.surfaces.cli.demo_dra import CLAIM_CORES, CLAIM_MIB, CLAIM_POD, dra_kubelet, start_claim
from agent.surfaces.cli.demo_mig import (
    DEEP,
    DEEP_AT_S,
    GPU_ARGS,
    MIN_ALONE_S,
    SPEC,
    STEADY,
    MigMeter,
    MigStory,
    Reading,
    mig_agent_args,
    mig_table,
    read,
    start_mig_pod,
)
from agent.surfaces.cli.demo_table import PodRow, gpu_line, pod_table
from agent.surfaces.statusclient import fetch_status

LOG_WIDTH = 165  # columns of the table when stdout is not a terminal (CI logs)
NON_INTERACTIVE_S = 30.0  # --duration default when stdout is not a terminal
PRINT_EVERY_S = 10.0
EVENT_LINES = 4  # how often a non-terminal run prints the table
XID_AT_S = 3.0
NEIGHBOUR_AT_S = 14.0


@dataclass(frozen=True)
class PodPlan:
    name: str
    cores: int
    annotations: dict[str, str] = field(default_factory=dict)
    memory_mib: int = 1024
    busy: float = 1.0
    pattern: tuple[str, ...] = ()  # sim-workload options: its pattern (default: a training loop)
    grow: tuple[str, ...] = ()  # sim-workload options that make it grow past its quota
    workload_mib: int = 0
    # Its RM_ALLOC / RM_CONTROL ioctls, as a CUDA process makes them: the tracer attributes them.
    driver: tuple[str, ...] = ("--driver-ioctls",)


# Admission order matters: the agent binpacks shares, so the first four fill GPU 0.
PODS = (
    PodPlan("cuda-share-50", 50, {CORE_LIMIT: "50"}, memory_mib=2048, workload_mib=1600),
    PodPlan("fixed-30", 30, {POLICY: "fixed-share"}, workload_mib=600, pattern=("--pattern", "graph")),
    PodPlan(
        "best-effort-10",
        10,
        {POLICY: "best-effort"},
        workload_mib=300,
        pattern=("--pattern", "infer", "--rate", "12"),  # about 10 % of the GPU
    ),
    PodPlan(
        "leaky-10",
        10,
        {POLICY: "fixed-share"},
        busy=0.1,
        workload_mib=800,
        grow=("--grow-to-mib", "1500", "--grow-after", "4"),  # early: a held, frozen process cannot grow
    ),
    PodPlan("burst-40", 40, {POLICY: "burst-share"}, busy=0.75, workload_mib=900),  # alone: up to 75 %
)
NEIGHBOUR = PodPlan("fixed-50", 50, {POLICY: "fixed-share"}, workload_mib=700)
CLAIM_PLAN = PodPlan(CLAIM_POD, CLAIM_CORES, memory_mib=CLAIM_MIB)  # from a ResourceClaim (demo_dra.py)


@dataclass
class Tracked:
    plan: PodPlan
    box: RunningContainer
    gpu_s: float = 0.0  # GPU seconds it had run at ``sampled`` (the GPU's ground truth)
    sampled: float = 0.0  # time.monotonic() of that reading


def run(workdir: Path, duration: float | None, metrics_address: str, console: Console) -> None:
    """Runs until ``duration`` seconds have passed (None: until Ctrl-C). Needs root and a
    cgroup v2 hierarchy; raises PlatformError where there is none."""
    logging.getLogger("agent.emulators").setLevel(logging.WARNING)  # the table tells the story
    workdir.mkdir(parents=True, exist_ok=True)
    with dra_kubelet(workdir) as (dirs, kubelet):
        agent_args = ("--metrics-address", metrics_address, *dirs.agent_args(), *mig_agent_args(workdir))
        with enforced_node(workdir, SPEC, gpu_args=GPU_ARGS, agent_args=agent_args) as node:
            url = wait_for(lambda: _metrics_url(node), 10, "the agent's metrics address")
            console.print(f"metrics: {url}  (Prometheus can scrape it; `vcuda-agent status` works too)")
            console.print(f"status: vcuda-agent status --socket {node.state_dir / 'status.sock'}")
            console.print(f"cgroups: {node.cgroup_root}")
            started = time.monotonic()  # t = 0 of the table and of --duration
            meter = MigMeter(node)
            try:
                story = MigStory()
                steady = start_mig_pod(node, STEADY)  # first: the longest time alone
                story.add(steady, meter)
                first = read(meter, steady)
                console.print(f"admitted pod {STEADY.name} ({STEADY.resource}: 1) on {steady.uuid}")
                deep_at = max(DEEP_AT_S, time.monotonic() - started + MIN_ALONE_S)
                pods = [_start(node, plan, console) for plan in PODS]
                claimed = start_claim(node, kubelet, dirs, console)
                pods.append(
                    Tracked(CLAIM_PLAN, claimed.box, node.gpu_seconds([claimed.box])[0], time.monotonic())
                )
                act = LiveAct(node, pods, duration, console, started)
                act.add_mig(meter, story, first, deep_at)
                act.run()  # its last table ends with the MIG comparison
            finally:
                meter.close()
            _crash(node, [p.box for p in pods], console)


def _metrics_url(node: EnforcedNode) -> str | None:
    for line in node.agent_log().splitlines():
        if "metrics on http://" in line:
            return line.split("metrics on ", 1)[1].split()[0]
    return None


def _start(node: EnforcedNode, plan: PodPlan, console: Console) -> Tracked:
    box = node.run_pod(
        plan.name,
        plan.cores,
        memory_mib=plan.memory_mib,
        busy=plan.busy,
        annotations=plan.annotations,
        workload_mib=plan.workload_mib,
        extra=plan.pattern + plan.grow + plan.driver,
    )
    console.print(f"admitted pod {plan.name} ({plan.cores} cores, {plan.memory_mib} MiB) on GPU {box.gpu}")
    return Tracked(plan, box, node.gpu_seconds([box])[0], time.monotonic())


class LiveAct:
    def __init__(
        self,
        node: EnforcedNode,
        pods: list[Tracked],
        duration: float | None,
        console: Console,
        started: float,
    ) -> None:
        self.node = node
        self.pods = pods
        self.console = console
        self.interactive = console.is_terminal
        self.duration = duration if duration is not None or self.interactive else NON_INTERACTIVE_S
        self.started = started
        self.seen_actions: set[tuple[float, str, str]] = set()
        self.events: list[str] = []  # the kills so far, shown under the live table
        self.steps: list[tuple[float, Callable[[], None]]] = [
            (XID_AT_S, self._xid),
            (NEIGHBOUR_AT_S, self._neighbour),
        ]
        self.mig: tuple[MigMeter, MigStory] | None = None

    def add_mig(self, meter: MigMeter, story: MigStory, first: Reading, deep_at: float) -> None:
        """The MIG rows, and the deep-queue tenant's arrival at ``deep_at``."""
        self.mig = (meter, story)

        def deep() -> None:
            story.mark_alone(meter, first)
            story.add(start_mig_pod(self.node, DEEP), meter)
            story.mark_beside(meter)
            self.console.print(
                f"  -> {DEEP.name} keeps a full queue of 50 ms kernels on the {DEEP.profile} instance"
            )

        self.steps = sorted([*self.steps, (deep_at, deep)], key=lambda step: step[0])

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def run(self) -> None:
        if self.interactive:
            with Live(console=self.console, auto_refresh=False, transient=False) as live:
                self._loop(lambda view: live.update(view, refresh=True))
        else:
            last_print = [0.0]

            def show(view: Any) -> None:
                if self.elapsed() - last_print[0] >= PRINT_EVERY_S or self._ending():
                    last_print[0] = self.elapsed()
                    self.console.print(view)

            self._loop(show)

    def _ending(self) -> bool:
        return self.duration is not None and self.elapsed() >= self.duration

    def _loop(self, show: Callable[[Any], None]) -> None:
        while True:  # at least one table, however long the admissions took
            tick = time.monotonic()
            while self.steps and self.elapsed() >= self.steps[0][0]:
                self.steps.pop(0)[1]()
            show(self._view())
            if self.duration is not None and self.elapsed() >= self.duration:
                return
            time.sleep(max(0.0, tick + 1.0 - time.monotonic()))

    def _view(self) -> Group:
        status = fetch_status(self.node.state_dir / "status.sock")
        rows = [
            PodRow(p.plan.name, real, self._exited(p))
            for p, real in zip(self.pods, self._real(), strict=True)
        ]
        left = "Ctrl-C to stop" if self.duration is None else f"of {self.duration:.0f} s"
        title = f"vcuda-agent demo: t = {self.elapsed():4.0f} s {left}"
        for line in self._new_actions(status):
            if self.interactive:
                self.events = [*self.events, line][-EVENT_LINES:]
            else:
                self.console.print(line)
        parts: list[Any] = [pod_table(title, status, rows), Text(gpu_line(status), style="dim")]
        if self.mig is not None:
            meter, story = self.mig
            story.refresh(meter)
            parts += [mig_table(story.rows, status), Text(story.comparison(meter), style="dim")]
        return Group(*parts, *(Text(line) for line in self.events))

    def _real(self) -> list[float | None]:
        """Percent of its GPU each workload really got since the last refresh (the GPU
        server's ground truth, not NVML's late samples)."""
        try:
            now_s = self.node.gpu_seconds([p.box for p in self.pods])
        except VcudaError:
            return [None] * len(self.pods)
        now = time.monotonic()
        reals: list[float | None] = []
        for pod, gpu_s in zip(self.pods, now_s, strict=True):
            running = pod.box.proc.poll() is None
            reals.append(100 * (gpu_s - pod.gpu_s) / max(now - pod.sampled, 1e-3) if running else None)
            pod.gpu_s, pod.sampled = gpu_s, now
        return reals

    @staticmethod
    def _exited(pod: Tracked) -> str:
        code = pod.box.proc.poll()
        if code is None:
            return ""
        return "killed" if code == -signal.SIGKILL else f"exited {code}"

    def _new_actions(self, status: dict[str, Any]) -> list[str]:
        lines = []
        for action in status.get("recentActions") or []:
            key = (float(action.get("time", 0)), str(action.get("container")), str(action.get("action")))
            if key in self.seen_actions or not str(action.get("action", "")).startswith("killed"):
                continue
            self.seen_actions.add(key)
            at = float(action.get("time", 0)) - status.get("time", 0) + self.elapsed()
            lines.append(
                f"  t = {at:.0f} s {action.get('container')}: {action.get('action')} ({action.get('detail')})"
            )
        return lines

    def _xid(self) -> None:
        post_event(self.node.runtime.sim_state_dir, 1, EventKind.XID.value, xid=13, detail="demo")
        self.console.print("  (XID 13, an application error, posted on GPU 1: counted, GPU stays healthy)")

    def _neighbour(self) -> None:
        self.pods.append(_start(self.node, NEIGHBOUR, self.console))
        self.console.print("  -> burst-40 now has a neighbour on GPU 1: it is brought back to its request")


def _crash(node: EnforcedNode, boxes: list[RunningContainer], console: Console) -> None:
    running = [b for b in boxes if b.proc.poll() is None]
    try:
        wait_for(lambda: any(frozen(b.cgroup) for b in running), 10, "a frozen container")
    except TimeoutError:
        console.print("\nno container was frozen in 10 s (is the node overloaded?): watchdog step skipped")
        return
    node.agent.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    node.agent.wait()
    wait_for(lambda: not any(frozen(b.cgroup) for b in running), 5, "the watchdog to thaw everything")
    console.print(
        f"\nagent SIGKILLed while throttling {len(running)} containers: the watchdog thawed all of them "
        f"after {1000 * (time.monotonic() - killed):.0f} ms"
    )
