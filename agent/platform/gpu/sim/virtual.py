"""Simulated GPUs and CUDA programs in virtual time, in one process (tests, model benches).

The same engines (:mod:`.engine`) and programs (:mod:`.programs`) as the GPU server and
its workload processes, with the operating system left out: each process is a program
stepped at the instants its calls return, a frozen process is simply not stepped (its
queued work still runs on the engine), and time only moves when :meth:`VirtualNode.run_until`
is asked to. A call's host cost is zero.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.platform.gpu.sim.calls import BlockedCall
from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import OutOfMemory
from agent.platform.gpu.sim.programs import Alloc, GraphLaunch, Launch, Op, Program, Sleep, Sync

MIB = 1 << 20
NUDGE_S = 1e-7  # a wake-up computed a hair early is retried this much later


@dataclass
class VirtualProcess:
    pid: int
    gpu: int
    program: Program
    ctx: Context
    frozen: bool = False
    wake_at: float = 0.0  # sleeping until (or runnable from) this time
    blocked: BlockedCall | None = None
    done: bool = False
    error: str = ""
    freezes: list[tuple[float, bool]] = field(default_factory=list)  # (time, frozen)
    waking: bool = False  # a sync returned: the host thread runs again at ``wake_at``


class VirtualNode:
    """GPUs and processes in virtual time starting at ``start`` (wall = monotonic + offset)."""

    def __init__(
        self, configs: Sequence[EngineConfig], *, start: float = 0.0, wall_offset_s: float = 0.0
    ) -> None:
        self.now = start
        self.engines = [GpuEngine(c, start, wall_offset_s, index=i) for i, c in enumerate(configs)]
        self.processes: list[VirtualProcess] = []
        self._pids = itertools.count(1000)
        self._wakes: dict[int, dict[int, float]] = {}  # gpu -> cid -> predicted time (valid until dirty)
        self._rng = random.Random(sum(c.seed for c in configs) * 7919 + len(configs))

    def spawn(
        self, gpu: int, program: Program, *, share: float = 1.0, mps_client: bool = False
    ) -> VirtualProcess:
        """``mps_client``: a client of the GPU's attached MPS server, at ``share``."""
        pid = next(self._pids)
        ctx = self.engines[gpu].create_context(pid, pid, self.now, share=share, mps_client=mps_client)
        proc = VirtualProcess(pid, gpu, program, ctx, wake_at=self.now)
        self.processes.append(proc)
        self._start(proc)
        return proc

    def kill(self, proc: VirtualProcess) -> None:
        self.run_until(self.now)
        self._end(proc)

    def _end(self, proc: VirtualProcess) -> None:
        proc.done = True
        proc.blocked = None
        self.engines[proc.gpu].destroy_context(proc.ctx, self.now)
        self._dirty(proc.gpu)

    def freeze(self, proc: VirtualProcess, now: float) -> None:
        self.run_until(now)
        proc.frozen = True
        proc.freezes.append((now, True))

    def thaw(self, proc: VirtualProcess, now: float) -> None:
        self.run_until(now)
        if proc.frozen:
            proc.frozen = False
            proc.freezes.append((now, False))
            proc.wake_at = max(proc.wake_at, now)

    # Running --------------------------------------------------------------------------------
    def run_until(self, until: float) -> None:
        """Step every process whose call returns before ``until``, then advance the GPUs."""
        while True:
            proc, at = self._next(until)
            if proc is None:
                break
            self.now = max(self.now, at)
            self._wake(proc)
        self.now = max(self.now, until)
        for engine in self.engines:
            engine.advance(self.now)

    def _next(self, until: float) -> tuple[VirtualProcess | None, float]:
        best: VirtualProcess | None = None
        best_at = math.inf
        for proc in self.processes:
            if proc.done or proc.frozen:
                continue
            at = proc.wake_at if proc.blocked is None else max(proc.wake_at, self._predicted(proc))
            if at < best_at:
                best, best_at = proc, at
        if best is None or best_at > until:
            return None, until
        return best, best_at

    def _predicted(self, proc: VirtualProcess) -> float:
        wakes = self._wakes.get(proc.gpu)
        if wakes is None:
            engine = self.engines[proc.gpu]
            waiting = {
                p.ctx.cid: p.blocked.awaits(engine, p.ctx)
                for p in self.processes
                if p.gpu == proc.gpu and p.blocked is not None and not p.done
            }
            wakes = self._wakes[proc.gpu] = engine.when_completed(waiting)
        return wakes.get(proc.ctx.cid, math.inf)

    def _dirty(self, gpu: int) -> None:
        self._wakes.pop(gpu, None)

    def _wake(self, proc: VirtualProcess) -> None:
        engine = self.engines[proc.gpu]
        if proc.blocked is not None:
            before = proc.ctx.queued
            if not proc.blocked.progress(engine, proc.ctx, self.now):
                if proc.ctx.queued != before:
                    self._dirty(proc.gpu)
                else:
                    proc.wake_at = self.now + NUDGE_S
                    self._dirty(proc.gpu)
                return
            self._dirty(proc.gpu)
            wake = self._host_wake(proc) if proc.blocked.sync else 0.0
            proc.blocked = None
            if wake > 0:  # the host thread that waited wakes up a little later
                proc.wake_at, proc.waking = self.now + wake, True
                return
        proc.waking = False
        self._resume(proc, self.now)

    def _host_wake(self, proc: VirtualProcess) -> float:
        """How long after its queue drained a process that synced runs again (uniform
        within ±50 % of the engine's ``host_wake_s``, seeded)."""
        mean = self.engines[proc.gpu].config.host_wake_s
        return mean * (0.5 + self._rng.random()) if mean > 0 else 0.0

    def _start(self, proc: VirtualProcess) -> None:
        try:
            op = next(proc.program)
        except StopIteration:
            self._end(proc)
            return
        if self._issue(proc, op):
            self._resume(proc, self.now)

    def _resume(self, proc: VirtualProcess, at: float) -> None:
        """Send the time a call returned at and issue the program's next calls."""
        while not proc.done:
            try:
                op = proc.program.send(at)
            except StopIteration:
                self._end(proc)
                return
            if not self._issue(proc, op):
                return

    def _issue(self, proc: VirtualProcess, op: Op) -> bool:
        """Start ``op``; True when it returned at once (the program goes on at the same time)."""
        engine = self.engines[proc.gpu]
        if isinstance(op, Sleep):
            proc.wake_at = self.now + max(0.0, op.seconds)
            return False
        if isinstance(op, Alloc):
            try:
                engine.allocate(proc.ctx, op.mib * MIB)
            except OutOfMemory as err:
                proc.error = str(err)
                self._end(proc)
                return False
            return True
        if isinstance(op, Launch | GraphLaunch):
            call = (
                BlockedCall(left=op.count, each_s=op.kernel_s)
                if isinstance(op, Launch)
                else BlockedCall(left=1, each_s=op.kernels * op.kernel_s)
            )
        else:
            assert isinstance(op, Sync)
            call = BlockedCall(sync=True)
        queued = proc.ctx.queued
        done = call.progress(engine, proc.ctx, self.now)
        if proc.ctx.queued != queued:
            self._dirty(proc.gpu)
        if done:
            return True
        proc.blocked = call
        proc.wake_at = self.now
        self._dirty(proc.gpu)
        return False
