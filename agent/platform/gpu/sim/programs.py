"""What simulated CUDA programs do: each pattern is a generator of driver operations.

A program yields operations and is sent back, for each, the time (seconds, monotonic) at
which it completed. The same programs run as real processes against the GPU server
(:mod:`.workload`) and in virtual time against engines in this process (:mod:`.virtual`),
so the tests' model workloads are the demo's and the benches' workloads.

The operations follow CUDA's blocking rules (the driver that runs them enforces them):

- :class:`Launch`: ``count`` kernel launches of ``kernel_s`` GPU seconds each, one queue
  entry per kernel; returns once all are queued (at once while the queue has room).
- :class:`GraphLaunch`: one CUDA graph of ``kernels`` kernels: one queue entry.
- :class:`Sync`: returns when the context's queue is empty.
- :class:`Sleep`: host time (CPU work, I/O, waiting for requests): no GPU use.
- :class:`Alloc`: device memory (negative: free); may fail with out-of-memory.

Patterns (``PatternSpec``):

- ``train``: steps of ``kernels`` kernels then a sync; with ``busy`` < 1 the host works
  between steps so the steps keep an otherwise idle GPU busy ``busy`` of the time;
- ``infer``: requests arriving at ``rate`` per second (Poisson, seeded; or from
  ``clients`` closed-loop clients), each ``kernels`` kernels and a sync, served in order;
  request latency (arrival to sync) is recorded;
- ``burn``: gpu_burn-like: batches of long kernels into a queue kept full, a sync only
  every ``sync_every`` launches (0: never);
- ``graph``: graph launches of ``kernels`` kernels, a sync every ``sync_every`` graphs;
- ``bursty``: ``train`` steps for ``on_s`` seconds, idle for ``off_s``, repeated.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

from agent.errors import InvalidSpecError

PATTERNS = ("train", "infer", "burn", "graph", "bursty")
BURN_BATCH = 64  # launches per call while burn keeps its queue full
LATENCIES_KEPT = 100_000


@dataclass(frozen=True)
class Launch:
    count: int
    kernel_s: float


@dataclass(frozen=True)
class GraphLaunch:
    kernels: int
    kernel_s: float


@dataclass(frozen=True)
class Sync:
    pass


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Alloc:
    mib: int


Op = Launch | GraphLaunch | Sync | Sleep | Alloc
Program = Generator[Op, float, None]

# Per pattern: kernels per step/request/graph, kernel milliseconds, sync_every.
_DEFAULTS: dict[str, tuple[int, float, int]] = {
    "train": (20, 2.0, 1),
    "infer": (4, 2.0, 1),
    "burn": (1, 20.0, 0),
    "graph": (50, 1.0, 1),
    "bursty": (20, 2.0, 1),
}


@dataclass(frozen=True)
class PatternSpec:
    """A workload's pattern and its parameters (None: the pattern's default)."""

    pattern: str = "train"
    kernels: int | None = None
    kernel_ms: float | None = None
    busy: float = 1.0  # train, bursty
    rate: float = 30.0  # infer: requests per second
    clients: int = 0  # infer: 0 open loop (arrivals at rate); N: N clients, each waiting for its answer
    sync_every: int | None = None  # burn: launches per sync (0: never); graph: graphs per sync
    on_s: float = 3.0  # bursty
    off_s: float = 3.0  # bursty
    seed: int = 0

    @property
    def n_kernels(self) -> int:
        return self.kernels if self.kernels is not None else _DEFAULTS[self.pattern][0]

    @property
    def kernel_s(self) -> float:
        return (self.kernel_ms if self.kernel_ms is not None else _DEFAULTS[self.pattern][1]) / 1000

    @property
    def syncs_every(self) -> int:
        return self.sync_every if self.sync_every is not None else _DEFAULTS[self.pattern][2]

    def problems(self) -> list[str]:
        found = []
        if self.pattern not in PATTERNS:
            found.append(f"--pattern must be one of {', '.join(PATTERNS)}, got {self.pattern!r}")
            return found
        if self.kernels is not None and not 1 <= self.kernels <= 100_000:
            found.append(f"--kernels must be 1..100000, got {self.kernels}")
        if self.kernel_ms is not None and not 0.001 <= self.kernel_ms <= 60_000:
            found.append(f"--kernel-ms must be 0.001..60000, got {self.kernel_ms}")
        if not 0.0 <= self.busy <= 1.0:
            found.append(f"--busy must be between 0 and 1, got {self.busy}")
        if not 0 < self.rate <= 100_000:
            found.append(f"--rate must be > 0 and <= 100000 requests/s, got {self.rate}")
        if not 0 <= self.clients <= 10_000:
            found.append(f"--clients must be 0..10000, got {self.clients}")
        if self.sync_every is not None and self.sync_every < 0:
            found.append(f"--sync-every must be >= 0, got {self.sync_every}")
        if self.on_s <= 0 or self.off_s < 0:
            found.append(f"--on must be > 0 and --off >= 0, got {self.on_s} and {self.off_s}")
        return found

    def demand(self) -> float | None:
        """The share of an otherwise idle GPU the pattern keeps busy (None: all it can get)."""
        step = self.n_kernels * self.kernel_s
        if self.pattern == "train":
            return self.busy
        if self.pattern == "infer":
            return min(1.0, self.rate * step)
        if self.pattern == "bursty":
            return self.busy * self.on_s / (self.on_s + self.off_s)
        return None


@dataclass
class WorkloadStats:
    """What a program did, for its report."""

    launches: int = 0
    syncs: int = 0
    requests: int = 0
    latencies_s: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)  # when each of those was answered
    phases: list[tuple[float, bool]] = field(default_factory=list)  # bursty: (time, now on)
    started_at: float | None = None  # the program's clock when it started (a real workload's)

    def latency(self, q: float, since: float | None = None) -> float | None:
        """The ``q`` quantile (0..1) of request latency, seconds (of the requests answered
        at ``since`` or later)."""
        kept = [
            s
            for s, at in zip(self.latencies_s, self.answered_at, strict=True)
            if since is None or at >= since
        ]
        if not kept:
            return None
        ordered = sorted(kept)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def record(self, latency: float, answered_at: float = 0.0) -> None:
        self.requests += 1
        if len(self.latencies_s) < LATENCIES_KEPT:
            self.latencies_s.append(latency)
            self.answered_at.append(answered_at)


def pattern_program(spec: PatternSpec, stats: WorkloadStats) -> Program:
    """The generator for ``spec``."""
    problems = spec.problems()
    if problems:
        raise InvalidSpecError("; ".join(problems))
    return {
        "train": _train,
        "infer": _infer,
        "burn": _burn,
        "graph": _graph,
        "bursty": _bursty,
    }[spec.pattern](spec, stats)


def _train(spec: PatternSpec, stats: WorkloadStats) -> Program:
    k, kernel = spec.n_kernels, spec.kernel_s
    if spec.busy <= 0:
        while True:
            yield Sleep(1.0)
    think = k * kernel * (1 - spec.busy) / spec.busy
    while True:
        yield Launch(k, kernel)
        stats.launches += k
        yield Sync()
        stats.syncs += 1
        if think > 0:
            yield Sleep(think)


def _infer(spec: PatternSpec, stats: WorkloadStats) -> Program:
    """Open loop: Poisson arrivals at ``rate``, whatever the latency (an overloaded server's
    backlog grows). Closed loop (``clients``): each client waits for its answer, then thinks
    for an exponential time of mean ``clients / rate``, so the offered load is ``rate``
    while answers are quick and falls when they are slow (latency stays bounded)."""
    rng = random.Random(spec.seed)
    k, kernel = spec.n_kernels, spec.kernel_s
    now = yield Sleep(0.0)
    arrivals: list[float] = []  # a heap of future arrivals
    if spec.clients:
        for _ in range(spec.clients):
            heapq.heappush(arrivals, now + rng.expovariate(spec.rate / spec.clients))
    else:
        arrivals.append(now + rng.expovariate(spec.rate))
    backlog: deque[float] = deque()
    while True:
        while arrivals and arrivals[0] <= now:
            came = heapq.heappop(arrivals)
            backlog.append(came)
            if not spec.clients:
                heapq.heappush(arrivals, came + rng.expovariate(spec.rate))
        if not backlog:
            now = yield Sleep(arrivals[0] - now)
            continue
        came = backlog.popleft()
        yield Launch(k, kernel)
        stats.launches += k
        now = yield Sync()
        stats.syncs += 1
        stats.record(now - came, now)
        if spec.clients:
            heapq.heappush(arrivals, now + rng.expovariate(spec.rate / spec.clients))


def _burn(spec: PatternSpec, stats: WorkloadStats) -> Program:
    since_sync = 0
    while True:
        yield Launch(BURN_BATCH, spec.kernel_s)
        stats.launches += BURN_BATCH
        since_sync += BURN_BATCH
        if spec.syncs_every and since_sync >= spec.syncs_every:
            yield Sync()
            stats.syncs += 1
            since_sync = 0


def _graph(spec: PatternSpec, stats: WorkloadStats) -> Program:
    since_sync = 0
    while True:
        yield GraphLaunch(spec.n_kernels, spec.kernel_s)
        stats.launches += 1
        since_sync += 1
        if since_sync >= max(1, spec.syncs_every):
            yield Sync()
            stats.syncs += 1
            since_sync = 0


def _bursty(spec: PatternSpec, stats: WorkloadStats) -> Program:
    k, kernel = spec.n_kernels, spec.kernel_s
    think = k * kernel * (1 - spec.busy) / spec.busy if spec.busy > 0 else spec.on_s
    now = yield Sleep(0.0)
    while True:
        phase_end = now + spec.on_s
        stats.phases.append((now, True))
        while now < phase_end:  # a phase ends between steps
            if spec.busy > 0:
                yield Launch(k, kernel)
                stats.launches += k
                now = yield Sync()
                stats.syncs += 1
            if think > 0:
                now = yield Sleep(think)
        stats.phases.append((now, False))
        if spec.off_s > 0:
            now = yield Sleep(spec.off_s)


def with_memory(
    program: Program,
    memory_mib: int,
    grow_to_mib: int | None = None,
    grow_after_s: float = 0.0,
    *,
    grow_step_mib: int = 0,
    grow_every_s: float = 0.0,
) -> Program:
    """``program`` with ``memory_mib`` allocated first and, after ``grow_after_s``, grown to
    ``grow_to_mib``: at once (``grow_step_mib`` 0) or by ``grow_step_mib`` every
    ``grow_every_s`` on a fixed schedule. Steps happen between the program's operations; a
    host pause (Sleep) is cut short at a step, so steps are on time while the program idles."""
    now = yield (Alloc(memory_mib) if memory_mib > 0 else Sleep(0.0))
    held = memory_mib
    grow_at = None if grow_to_mib is None else now + grow_after_s
    op = next(program)
    while True:
        if grow_at is not None and grow_to_mib is not None and now >= grow_at:
            step = grow_to_mib - held if grow_step_mib <= 0 else min(grow_step_mib, grow_to_mib - held)
            held += step
            grow_at = grow_at + grow_every_s if grow_step_mib > 0 and held < grow_to_mib else None
            now = yield Alloc(step)
            continue
        if isinstance(op, Sleep) and grow_at is not None and now + op.seconds > grow_at:
            wait = max(0.0, grow_at - now)
            now = yield Sleep(wait)
            op = Sleep(op.seconds - wait)
            continue
        now = yield op
        op = program.send(now)
