"""One simulated GPU: contexts with queues of submitted work, executed in simulated time.

What it models (docs/reference.md, "How a GPU executes work"):

- **Contexts and queues.** One context per workload process. A context holds a FIFO of
  launches; a launch is a kernel of some GPU time (seconds of the whole GPU), or a CUDA
  graph (many kernels, one launch). The queue holds at most ``queue_depth`` launches: a
  launch into a full queue waits for room, a sync waits for the queue to drain (the server
  and the virtual driver do the waiting; the engine says when).
- **Queued work runs on its own.** Nothing here knows whether the submitting process runs
  or is frozen: work already queued keeps executing until the queue is empty.
- **Time-slicing** (default): contexts with queued work take turns of one timeslice
  (default 2 ms); work longer than a slice is preempted at its end and resumed
  (compute preemption). **MPS** (per GPU): clients run concurrently, each at most at its
  active-thread percentage of the GPU, sharing fairly when the active ones ask for more
  than the whole GPU (see :mod:`.schedule`; a real H200 was seen to divide less fairly).
  Either the whole GPU is in MPS mode from the start (``EngineConfig.mps``), or an MPS
  server is attached (an MPS control daemon, :meth:`GpuEngine.attach_mps_server`): then
  only its clients may open contexts (the GPU is in EXCLUSIVE_PROCESS compute mode, as
  NVIDIA advises for MPS), and when it goes away its clients' contexts go with it. A
  client may carry a pinned device-memory limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``): an
  allocation over it fails.
- **Driver memory limits per cgroup** (``nvmlDeviceSetMemoryLimits_v1``): an allocation
  that would take the processes of a limited cgroup (and its descendants) over the limit
  fails with out-of-memory; nothing is killed.
- **Ground truth.** Exact GPU time per context and per GPU, to the instant asked.
- **NVML's view** (:mod:`.perfmon`, :mod:`.nvmllib`; docs/gpu-model.md): by default as
  NVIDIA's driver makes it: one per-process sample per sample period crediting the ONE
  process executing at its end with its SM activity, a ring of 72, visible
  ``sample_delay_s`` plus up to ``sample_jitter_s`` (seeded) after the period, handed out
  per call as ``nvml_aggregation`` says; device samples (busy percent of every period)
  visible at once. Context switches cost ``switch_s`` of busy engine time; a process
  returns from a sync ``host_wake_s`` late. ``EngineConfig.ideal`` turns all of that off
  (every context that ran gets its exact share of each period). Under an attached MPS
  server NVML attributes the clients' work to the server process (NVIDIA's MPS
  documentation; seen on an H200), ``mps_samples="client"`` to each client. Memory stays
  per client, as ``nvmlDeviceGetMPSComputeRunningProcesses`` reports it.

Not modelled: memory-bandwidth or cache interference between contexts, SM placement and
occupancy (a kernel uses the whole GPU, or its MPS share, for its duration), host-device
copies as separate engines, clocks and power, MIG.

The engine keeps no clock of its own: every call passes ``now`` (seconds, one monotonic
clock), so tests run it in virtual time. Nothing here blocks or burns CPU: work is
accounted for when someone asks, from the schedule functions.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Mapping

from agent.platform.gpu.inventory import DeviceSample
from agent.platform.gpu.sim.context import Context, ContextTruth
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.memory import check_allocation
from agent.platform.gpu.sim.nvmllib import process_utilization
from agent.platform.gpu.sim.perfmon import NO_PROCESS, Perfmon, PeriodUse, Sample
from agent.platform.gpu.sim.schedule import EPS, RoundRobin, Served, serve_concurrent


class GpuEngine:
    """The engine of one GPU (see the module docstring). Not thread-safe: one owner."""

    def __init__(self, config: EngineConfig, now: float, wall_offset_s: float, *, index: int = 0) -> None:
        config.validate()
        self.config = config
        self.index = index
        self.now = now
        self.wall_offset_s = wall_offset_s  # wall time = monotonic time + this
        self.lost = False
        self.contexts: list[Context] = []
        self._next_cid = 1
        self._slices = RoundRobin(config.timeslice_s, switch_s=config.switch_s)
        self._origin = now
        self._period = 0  # index of the sample period in progress
        # pid -> (GPU time, SM-seconds) this period, of contexts gone
        self._departed: dict[int, tuple[float, float]] = {}
        self._rng = random.Random(config.seed * 1009 + index)
        credit_periods = max(1, round(config.credit_window_s / config.sample_period_s))
        self.perfmon = Perfmon(config.nvml_view, config.sample_credit, credit_periods)
        self._last_visible = now
        self._period_busy = 0.0
        self.busy_s = 0.0  # time with any context running
        self.work_s = 0.0  # GPU time executed, summed over contexts (= busy_s without MPS)
        self.mps_server_pid: int | None = None  # an attached MPS server (control daemon)
        self.cgroup_limits: dict[str, int] = {}  # cgroup directory -> bytes (driver limits)
        # (pid, start ticks, peak memory bytes) of contexts that are gone, newest last: how
        # much a killed process held at most (bench/quota_overshoot.py)
        self.departed_peaks: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=256)

    @property
    def mps(self) -> bool:
        return self.config.mps or self.mps_server_pid is not None

    # Contexts -------------------------------------------------------------------------------
    def create_context(
        self,
        pid: int,
        start_ticks: int,
        now: float,
        *,
        share: float = 1.0,
        mps_client: bool = False,
        memory_limit: int | None = None,
        cgroup: str = "",
        sm_activity: float | None = None,
    ) -> Context:
        """``sm_activity``: what the process's kernels show as SM activity (None: the GPU's
        default for a compute-bound loop)."""
        self.advance(now)
        activity = self.config.sm_activity if sm_activity is None else min(1.0, max(0.01, sm_activity))
        ctx = Context(
            self._next_cid,
            pid,
            start_ticks,
            share=min(1.0, max(0.01, share)),
            mps_client=mps_client,
            memory_limit=memory_limit,
            cgroup=cgroup,
            sm_activity=activity,
        )
        self._next_cid += 1
        self.contexts.append(ctx)
        return ctx

    def attach_mps_server(self, pid: int, now: float) -> None:
        """An MPS server serves this GPU from now on (its clients run concurrently)."""
        self.advance(now)
        self.mps_server_pid = pid

    def detach_mps_server(self, now: float) -> list[Context]:
        """The MPS server went away: its clients' contexts are destroyed (returned)."""
        self.advance(now)
        self.mps_server_pid = None
        gone = [c for c in self.contexts if c.mps_client]
        for ctx in gone:
            self.destroy_context(ctx, now)
        return gone

    def set_cgroup_limit(self, cgroup: str, limit_bytes: int | None) -> None:
        """The driver's hard memory limit for a cgroup's processes (None clears it)."""
        if limit_bytes is None:
            self.cgroup_limits.pop(cgroup, None)
        else:
            self.cgroup_limits[cgroup] = limit_bytes

    def destroy_context(self, ctx: Context, now: float) -> None:
        """The process exited (or was killed): its queued work is dropped, its memory freed."""
        self.advance(now)
        if ctx not in self.contexts:
            return
        i = self.contexts.index(ctx)
        self.contexts.pop(i)
        if ctx.period_ran > 0:
            pid = self._credited_pid(ctx)
            ran, act = self._departed.get(pid, (0.0, 0.0))
            self._departed[pid] = (ran + ctx.period_ran, act + ctx.period_ran * ctx.sm_activity)
        slices = self._slices
        if i < slices.cursor:
            slices.cursor -= 1  # the same context holds the GPU, its slice goes on
        elif i == slices.cursor or slices.cursor >= len(self.contexts):
            slices.cursor = i if i < len(self.contexts) else 0  # the next one, on a fresh slice
            slices.slice_left = -1.0
        if i == slices.last:
            slices.last, slices.switch_left = -1, 0.0  # its state is gone: the next one loads
        elif i < slices.last:
            slices.last -= 1
        ctx.groups.clear()
        self.departed_peaks.append((ctx.pid, ctx.start_ticks, ctx.peak_memory_bytes))
        ctx.queued, ctx.pending, ctx.memory_bytes = 0, 0.0, 0

    def room(self, ctx: Context) -> int:
        return max(0, self.config.queue_depth - ctx.queued)

    def submit(self, ctx: Context, count: int, each_s: float, now: float) -> int:
        """Queue up to ``count`` launches of ``each_s`` GPU seconds; returns how many fit."""
        self.advance(now)
        take = min(count, self.room(ctx))
        if take <= 0 or each_s < 0:
            return 0
        if ctx.groups and abs(ctx.groups[-1][1] - each_s) <= EPS:
            ctx.groups[-1][0] += take  # launches of one size queue as one group
        else:
            ctx.groups.append([float(take), each_s])
        ctx.queued += take
        ctx.pending += take * each_s
        return take

    def allocate(self, ctx: Context, nbytes: int) -> None:
        if nbytes > 0:
            check_allocation(
                ctx,
                nbytes,
                gpu=self.index,
                capacity=self.config.memory_bytes,
                contexts=self.contexts,
                cgroup_limits=self.cgroup_limits,
            )
        ctx.memory_bytes = max(0, ctx.memory_bytes + nbytes)
        ctx.peak_memory_bytes = max(ctx.peak_memory_bytes, ctx.memory_bytes)

    # Time -----------------------------------------------------------------------------------
    def _serve(self, span: float, goals: Mapping[int, float] | None = None) -> Served:
        remaining = [c.pending for c in self.contexts]
        if self.mps:
            return serve_concurrent(remaining, [c.share for c in self.contexts], span, goals)
        if span == math.inf:  # a prediction: the schedule itself must not move
            return self._slices.copy().serve(remaining, span, goals)
        return self._slices.serve(remaining, span, goals)

    def _period_end(self) -> float:
        return self._origin + (self._period + 1) * self.config.sample_period_s

    def advance(self, now: float) -> None:
        """Execute queued work up to ``now``, closing the sample periods it crosses."""
        period = self.config.sample_period_s
        while self.now < now:
            end = min(now, self._period_end())
            working = not self.lost and any(c.pending > EPS for c in self.contexts)
            if working:
                result = self._serve(end - self.now)
                for ctx, amount in zip(self.contexts, result.served, strict=True):
                    ctx.consume(amount)
                    self.work_s += amount
                self.busy_s += result.busy
                self._period_busy += result.busy
            self.now = end
            if end < self._period_end() - EPS:
                continue
            self._close_period()
            if not any(c.pending > EPS for c in self.contexts):
                # Idle: the whole periods up to ``now`` did nothing; record them at once.
                current = int((now - self._origin) / period)
                if current > self._period:
                    ends = [
                        self._origin + (k + 1) * period
                        for k in range(max(self._period, current - 4096), current)
                    ]
                    self.perfmon.record_idle([(self._stamp(e), e, self._visible(e)) for e in ends], period)
                    self._period = current
                    self.now = max(self.now, self._origin + current * period)

    def _stamp(self, end: float) -> int:
        return round((end + self.wall_offset_s) * 1_000_000)

    def _visible(self, end: float) -> float:
        """When NVML first reports a sample of the period that ended at ``end``."""
        late = self.config.sample_delay_s + self.config.sample_jitter_s * self._rng.random()
        self._last_visible = max(self._last_visible, end + late)
        return self._last_visible

    def _credited_pid(self, ctx: Context) -> int:
        """Whom the driver credits with a context's work: the MPS server for its clients
        (in the ``server`` attribution), else its own process."""
        server = self.mps_server_pid if self.config.mps_samples == "server" else None
        return server if server is not None and ctx.mps_client else ctx.pid

    def _executing(self) -> int:
        """The process whose context executes on the engine now (time-slicing), or the MPS
        server whose clients share it."""
        if self.mps:
            working = any(c.pending > EPS for c in self.contexts)
            return (self.mps_server_pid or NO_PROCESS) if working else NO_PROCESS
        last = self._slices.last
        if not 0 <= last < len(self.contexts) or self.contexts[last].pending <= EPS:
            return NO_PROCESS  # idle: nothing executes
        return self.contexts[last].pid

    def _close_period(self) -> None:
        end = self._period_end()
        ran = {pid: r for pid, (r, _a) in self._departed.items()}
        activity = {pid: a for pid, (_r, a) in self._departed.items()}
        for ctx in self.contexts:
            if ctx.period_ran > 0:
                pid = self._credited_pid(ctx)
                ran[pid] = ran.get(pid, 0.0) + ctx.period_ran
                activity[pid] = activity.get(pid, 0.0) + ctx.period_ran * ctx.sm_activity
            ctx.period_ran = 0.0
        use = PeriodUse(self.config.sample_period_s, ran, activity, self._period_busy, self._executing())
        per_process = self.mps and (self.mps_server_pid is None or self.config.mps_samples == "client")
        self.perfmon.record(use, self._stamp(end), self.now, self._visible(end), per_process=per_process)
        self._period_busy = 0.0
        self._departed = {}
        self._period += 1

    # Predictions ----------------------------------------------------------------------------
    def when_completed(self, wants: Mapping[int, int]) -> dict[int, float]:
        """For contexts (by cid) waiting for their first ``n`` launches to complete (``n`` =
        all queued: a sync), the time each will be done if nothing new is submitted; a
        context that can never be done (a lost GPU) is left out."""
        if self.lost:
            return {}
        goals: dict[int, float] = {}
        for i, ctx in enumerate(self.contexts):
            n = wants.get(ctx.cid)
            if n is not None:
                goals[i] = ctx.time_to_complete(n) if n < ctx.queued else ctx.pending
        if not goals:
            return {}
        result = self._serve(math.inf, goals)
        return {self.contexts[i].cid: self.now + at for i, at in result.reached.items()}

    # NVML's view ----------------------------------------------------------------------------
    def samples(self, since_us: int, now: float) -> list[Sample]:
        """What ``nvmlDeviceGetProcessUtilization(lastSeenTimeStamp=since_us)`` returns at
        ``now``: the driver's visible samples as NVML aggregates them (:mod:`.nvmllib`)."""
        self.advance(now)
        aggregation = self.config.nvml_aggregation if self.config.nvml_view == "driver" else "per-sample"
        return process_utilization(self.perfmon.samples(since_us, now), since_us, aggregation)

    def driver_samples(self, since_us: int, now: float) -> list[Sample]:
        """The driver's per-process samples themselves (pid 0: none resident)."""
        self.advance(now)
        return self.perfmon.samples(since_us, now)

    def device_samples(self, since_us: int, now: float) -> list[DeviceSample]:
        """``nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES, lastSeenTimeStamp=since_us)``."""
        self.advance(now)
        return self.perfmon.device_samples(since_us, now)

    def device_utilization(self, now: float) -> int:
        self.advance(now)
        return self.perfmon.last_device_util(now)

    def memory(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for ctx in self.contexts:
            if ctx.memory_bytes > 0:
                used[ctx.pid] = used.get(ctx.pid, 0) + ctx.memory_bytes
        return used

    def truth(self, now: float) -> list[ContextTruth]:
        self.advance(now)
        return [
            ContextTruth(
                c.pid, c.start_ticks, c.ran, c.queued, c.pending, c.memory_bytes, c.peak_memory_bytes
            )
            for c in self.contexts
        ]

    def set_lost(self, lost: bool, now: float) -> list[Context]:
        """The GPU fell off the bus (its contexts are gone: returned) or was reset."""
        self.advance(now)
        self.lost = lost
        gone = list(self.contexts) if lost else []
        for ctx in gone:
            self.destroy_context(ctx, now)
        return gone
