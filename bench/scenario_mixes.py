"""Random mixes of containers on one simulated GPU, and the runs ``bench/scenarios.py`` scores.

A *mix* (:func:`generate_mix`, seeded: mix ``i`` of seed ``S`` draws from
``random.Random(f"{S}:{i}")``) is one GPU's device sample period and 2-4 containers, each
with a workload pattern, its own kernel length and a policy, over two phases of equal
length: every container but possibly one starts at 0, and at the half one change (a new
container starts, one stops, or nothing).

:func:`simulate` runs some of a mix's containers on that timeline in virtual time, with a
controller (:class:`ModelController`, built by a :data:`ControllerFactory`) or without one,
and records a :class:`Trace`: every ``STEP_S`` of virtual time, the engine's ground truth of
each container's GPU seconds (``ctx.ran``) and whether it is frozen with work it cannot run;
its freeze records; and, each second, the controller's own reading of each container.
:func:`references` are the runs without a controller that say what each container should get:
each container alone on the GPU, and all of them together unthrottled (the GPU's capacity).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from enforcement_model import PERIOD_S, Box, box_spec

from agent.clock import VirtualClock
from agent.domain.specs import EnforcementSpec
from agent.emulators.virtualgpu import VirtualGpuNode
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import PatternSpec, WorkloadStats, pattern_program

SAMPLE_PERIODS = (1 / 6, 0.25, 0.5, 1.0)
PATTERN_KINDS = ("train", "infer-open", "infer-closed", "graph", "bursty")
POLICIES = ("fixed-share", "burst-share", "best-effort")
BURN_P = 0.15  # with --deep-queues: the chance a container is gpu_burn-like
BEST_EFFORT_P = 0.5  # the chance a mix has a best-effort container...
SECOND_BEST_EFFORT_P = 0.3  # ...and, with 3 or more containers, a second one
CHANGES = ("start", "stop", "none")  # at the half
STEP_S = 0.05  # the truth's time step (a fifth of a control period)
READ_EVERY_S = 1.0  # the controller's reading is taken this often
VIEW_WINDOW_S = 10.0  # ...over this much measured time
CLOCK_START = 1000.0  # VirtualClock's default


@dataclass(frozen=True)
class Member:
    """One container of a mix."""

    name: str
    kind: str  # a PATTERN_KINDS entry, or "burn"
    pattern: PatternSpec
    policy: str  # a POLICIES entry
    cores: int  # fixed-share: its cap; burst-share: its request; best-effort: its request
    limit: int | None = None  # burst-share's vcuda-core-limit (None: unset, it may burst to 100)
    start_phase: int = 0
    stop_phase: int | None = None  # killed at the start of this phase (None: runs to the end)
    load: float = 1.0  # infer: the offered load (share of the GPU) it was drawn with

    def runs_in(self, phase: int) -> bool:
        """Runs the whole of ``phase``."""
        return self.start_phase <= phase and (self.stop_phase is None or phase < self.stop_phase)

    def describe(self) -> str:
        p = self.pattern
        what = f"{self.kind} {p.kernel_s * 1000:.1f}ms"
        if self.kind == "train":
            what += f" busy {p.busy:.2f}"
        elif self.kind in ("infer-open", "infer-closed"):
            what += f" load {self.load:.2f}" + (f" x{p.clients}" if p.clients else "")
        elif self.kind == "bursty":
            what += f" on {p.on_s:.1f}/off {p.off_s:.1f}s"
        if self.policy == "fixed-share":
            return f"{self.name}: {what}, fixed {self.cores}"
        if self.policy == "burst-share":
            return f"{self.name}: {what}, burst {self.cores}-{self.limit or 100}"
        return f"{self.name}: {what}, best-effort ({self.cores})"


@dataclass(frozen=True)
class Mix:
    index: int
    sample_period_s: float
    engine_seed: int
    members: tuple[Member, ...]
    phase_s: float
    change: str  # a CHANGES entry

    def engine(self) -> EngineConfig:
        return EngineConfig(sample_period_s=self.sample_period_s, seed=self.engine_seed)

    def phase(self, n: int) -> list[Member]:
        return [m for m in self.members if m.runs_in(n)]

    def window(self, n: int, settle_s: float) -> tuple[float, float]:
        """Phase ``n``'s scored window, virtual monotonic time."""
        start = CLOCK_START + n * self.phase_s
        return start + settle_s, start + self.phase_s


def member_spec(member: Member) -> EnforcementSpec:
    """What the agent's ledger would hand the controller (as ``box_spec``; the cap and
    limit_set as ``agent.domain.specs.build_spec`` derives them: no vcuda-core-limit → the cap
    is the request, so a burst-share without one may burst to 100, a best-effort one has no
    ceiling whatever its cap)."""
    limit_set = member.policy == "burst-share" and member.limit is not None
    spec = box_spec(Box(member.name, member.cores, member.policy))
    return replace(
        spec,
        cap=member.limit if limit_set and member.limit is not None else member.cores,
        limit_set=limit_set,
    )


def _pattern(rng: random.Random, deep_queues: bool) -> tuple[str, PatternSpec, float]:
    kind = "burn" if deep_queues and rng.random() < BURN_P else rng.choice(PATTERN_KINDS)
    kernel_ms = math.exp(rng.uniform(math.log(1.0), math.log(40.0)))
    seed = rng.randrange(1 << 30)
    load = 1.0
    if kind == "train":
        busy = 1.0 if rng.random() < 0.4 else rng.uniform(0.2, 1.0)
        return kind, PatternSpec("train", kernel_ms=kernel_ms, busy=busy, seed=seed), load
    if kind in ("infer-open", "infer-closed"):
        closed = kind == "infer-closed"
        # Open loop: an offered load of 0.1-0.8 of the GPU. Closed loop: 1-8 clients whose
        # offered load (while answers are quick) is 0.3-3 GPUs: a server that may be loaded past
        # any cap, its clients slowing down with their answers.
        load = rng.uniform(0.3, 3.0) if closed else rng.uniform(0.1, 0.8)
        clients = rng.randint(1, 8) if closed else 0
        step = PatternSpec("infer", kernel_ms=kernel_ms)
        rate = load / (step.n_kernels * step.kernel_s)
        spec = PatternSpec("infer", kernel_ms=kernel_ms, rate=rate, clients=clients, seed=seed)
        return kind, spec, load
    if kind == "bursty":
        on_s, off_s = rng.uniform(0.3, 8.0), rng.uniform(0.5, 6.0)
        return kind, PatternSpec("bursty", kernel_ms=kernel_ms, on_s=on_s, off_s=off_s, seed=seed), load
    return kind, PatternSpec(kind, kernel_ms=kernel_ms, seed=seed), load  # graph, burn


def _policy(rng: random.Random, best_effort: bool) -> tuple[str, int, int | None]:
    if best_effort:
        return "best-effort", rng.randint(1, 10), None
    if rng.random() < 0.5:
        return "fixed-share", rng.randint(5, 90), None
    request = rng.randint(5, 60)
    return "burst-share", request, None if rng.random() < 0.5 else rng.randint(request + 1, 100)


def _fit(cores: list[int]) -> list[int]:
    """Requests scaled down to sum to at most 100 (each at least 1)."""
    total = sum(cores)
    if total <= 100:
        return cores
    out = [max(1, math.floor(c * 100 / total)) for c in cores]
    while sum(out) > 100:
        out[out.index(max(out))] -= 1
    return out


def generate_mix(
    seed: int, index: int, *, seconds: float, sample_period: float | None = None, deep_queues: bool = False
) -> Mix:
    """Mix ``index`` of ``seed`` (see the module docstring). Every container's request counts
    against the GPU's 100 units, a best-effort one's (1-10) too, as the device plugin hands
    them out: fixed caps, burst requests and best-effort requests sum to at most 100."""
    rng = random.Random(f"{seed}:{index}")
    period = rng.choice(SAMPLE_PERIODS)
    engine_seed = rng.randrange(1 << 30)
    n = rng.randint(2, 4)
    best = set()
    if rng.random() < BEST_EFFORT_P:
        best = set(rng.sample(range(n), 2 if n >= 3 and rng.random() < SECOND_BEST_EFFORT_P else 1))
    drawn = [(_pattern(rng, deep_queues), _policy(rng, i in best)) for i in range(n)]
    cores = _fit([c for _p, (_pol, c, _lim) in drawn])
    change = rng.choice(CHANGES)
    moved = rng.randrange(n)
    members = []
    for i, ((kind, pattern, load), (policy, _c, limit)) in enumerate(drawn):
        members.append(
            Member(
                name=chr(ord("a") + i),
                kind=kind,
                pattern=pattern,
                policy=policy,
                cores=cores[i],
                limit=limit,
                start_phase=1 if change == "start" and i == moved else 0,
                stop_phase=1 if change == "stop" and i == moved else None,
                load=load,
            )
        )
    return Mix(
        index=index,
        sample_period_s=sample_period if sample_period is not None else period,
        engine_seed=engine_seed,
        members=tuple(members),
        phase_s=seconds / 2,
        change=change,
    )


class ModelController(Protocol):
    """A compute-cap controller run in virtual time (the caller sleeps PERIOD_S between periods)."""

    def period(self) -> None: ...

    def release_all(self) -> None: ...

    def reading(self, spec: EnforcementSpec, window_s: float) -> tuple[float, float] | None:
        """Its own reading of the container's use (percent of the GPU) over the last
        ``window_s`` of measured time, and the virtual monotonic time that window ends at."""
        ...


ControllerFactory = Callable[
    [VirtualGpuNode, Callable[[], list[EnforcementSpec]], VirtualClock], ModelController
]


class SteppingClock(VirtualClock):
    """A virtual clock that stops at every ``step_s`` from its start as it advances and calls
    ``on_step`` there (the truth's probe), whoever sleeps on it."""

    def __init__(self, start: float, step_s: float) -> None:
        super().__init__(start)
        self._start, self._step, self._k = start, step_s, 0
        self.on_step: Callable[[float], None] = lambda _t: None

    def advance(self, seconds: float) -> None:
        target = self.monotonic() + max(0.0, seconds)
        while self._start + (self._k + 1) * self._step <= target + 1e-9:
            self._k += 1
            at = self._start + self._k * self._step
            super().advance(max(0.0, at - self.monotonic()))
            self.on_step(at)
        super().advance(max(0.0, target - self.monotonic()))


@dataclass
class Trace:
    """What one run recorded (see the module docstring); grid point ``i`` is ``t0 + i * step_s``."""

    t0: float
    step_s: float
    ran: dict[str, list[float]]  # GPU seconds so far, per grid point
    waiting: dict[str, list[bool]]  # frozen, not done and not in a host Sleep, per grid point
    freezes: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)  # (time, frozen)
    readings: list[tuple[float, str, float, float]] = field(default_factory=list)  # (at, name, %, end)

    def cum(self, name: str, t: float) -> float:
        """GPU seconds by ``t`` (linear between grid points; 0 before the first)."""
        series = self.ran[name]
        x = (t - self.t0) / self.step_s
        if x <= 0 or not series:
            return 0.0
        i = math.floor(x + 1e-9)
        if i >= len(series) - 1:
            return series[-1]
        frac = max(0.0, x - i)
        return series[i] + (series[i + 1] - series[i]) * frac

    def pct(self, name: str, start: float, end: float) -> float:
        """Percent of the GPU the container got over [start, end]."""
        return 100 * (self.cum(name, end) - self.cum(name, start)) / (end - start)

    def index(self, t: float) -> int:
        return round((t - self.t0) / self.step_s)


def simulate(mix: Mix, members: Sequence[Member], factory: ControllerFactory | None = None) -> Trace:
    """``members`` of ``mix`` on its timeline, with the controller ``factory`` builds (None:
    none, every container runs unthrottled)."""
    clock = SteppingClock(CLOCK_START, STEP_S)
    gpu = VirtualGpuNode(clock, [mix.engine()])
    running: list[Member] = []
    specs: list[EnforcementSpec] = []
    trace = Trace(CLOCK_START, STEP_S, {m.name: [] for m in members}, {m.name: [] for m in members})

    def probe(now: float) -> None:
        gpu.sync()
        for m in members:
            container = gpu.containers.get(m.name)
            if container is None:
                trace.ran[m.name].append(0.0)
                trace.waiting[m.name].append(False)
                continue
            p = container.process
            work = p.blocked is not None or p.waking or p.wake_at <= now
            trace.ran[m.name].append(p.ctx.ran)
            trace.waiting[m.name].append(p.frozen and not p.done and work)

    def begin(phase: int) -> None:
        for m in members:
            if m.stop_phase == phase and m in running:
                gpu.sync()
                gpu.node.kill(gpu.containers[m.name].process)
                running.remove(m)
            if m.start_phase == phase:
                gpu.add(m.name, 0, pattern_program(m.pattern, WorkloadStats()))
                running.append(m)
        specs[:] = [member_spec(m) for m in running]

    begin(0)
    controller = factory(gpu, lambda: specs, clock) if factory is not None else None
    clock.on_step = probe
    probe(CLOCK_START)
    per_phase = round(mix.phase_s / PERIOD_S)
    read_every = round(READ_EVERY_S / PERIOD_S)
    for k in range(2 * per_phase):
        if k == per_phase:
            begin(1)
        if controller is not None:
            controller.period()
            if k % read_every == 0:
                at = CLOCK_START + k * PERIOD_S
                for m, spec in zip(running, specs, strict=True):
                    got = controller.reading(spec, VIEW_WINDOW_S)
                    if got is not None:
                        trace.readings.append((at, m.name, got[0], got[1]))
        clock.sleep(CLOCK_START + (k + 1) * PERIOD_S - clock.monotonic())
    if controller is not None:
        controller.release_all()
    trace.freezes = {name: list(c.freezes) for name, c in gpu.containers.items()}
    return trace


@dataclass(frozen=True)
class References:
    """What the mix's containers do without a controller, per phase (percent of the GPU over
    the phase's scored window): each alone on the GPU, and the GPU's total with all together."""

    alone: dict[tuple[str, int], float]  # (name, phase) -> percent
    alone_bins: dict[tuple[str, int], list[float]]  # ...in each whole second of the window
    capacity: list[float]  # per phase, at most 100
    free: dict[tuple[str, int], float]  # (name, phase) -> percent, all of them unthrottled together


def references(mix: Mix, settle_s: float) -> References:
    alone: dict[tuple[str, int], float] = {}
    bins: dict[tuple[str, int], list[float]] = {}
    for m in mix.members:
        trace = simulate(mix, [m])
        for phase in (0, 1):
            if m.runs_in(phase):
                start, end = mix.window(phase, settle_s)
                alone[m.name, phase] = trace.pct(m.name, start, end)
                seconds = int(end - start + 1e-9)
                bins[m.name, phase] = [trace.pct(m.name, start + k, start + k + 1) for k in range(seconds)]
    together = simulate(mix, mix.members)
    free = {
        (m.name, phase): together.pct(m.name, *mix.window(phase, settle_s))
        for phase in (0, 1)
        for m in mix.phase(phase)
    }
    capacity = [min(100.0, sum(v for (_n, p), v in free.items() if p == phase)) for phase in (0, 1)]
    return References(alone, bins, capacity, free)
