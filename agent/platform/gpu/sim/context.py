"""One process's context on a simulated GPU: its queue of launches, and what it ran."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from agent.platform.gpu.sim.schedule import EPS


@dataclass(frozen=True)
class ContextTruth:
    """Exact figures for one context."""

    pid: int
    start_ticks: int
    ran_s: float  # GPU time executed since the context was created
    queued: int  # launches waiting or running
    pending_s: float  # GPU time still queued
    memory_bytes: int
    peak_memory_bytes: int = 0  # the most it ever held (how far a quota was overshot)


@dataclass
class Context:
    """One process's context on the GPU."""

    cid: int
    pid: int
    start_ticks: int
    share: float = 1.0  # MPS active-thread fraction (0..1]
    mps_client: bool = False  # runs under the GPU's attached MPS server
    memory_limit: int | None = None  # bytes: MPS pinned device-memory limit
    cgroup: str = ""  # the process's cgroup v2 directory (full path), for per-cgroup limits
    sm_activity: float = 1.0  # the SM activity its kernels show while they run (perfmon.py)
    groups: collections.deque[list[float]] = field(default_factory=collections.deque)  # [count, seconds each]
    head_done: float = 0.0  # GPU time already spent on the first queued launch
    queued: int = 0
    pending: float = 0.0
    ran: float = 0.0
    period_ran: float = 0.0
    memory_bytes: int = 0
    peak_memory_bytes: int = 0

    def consume(self, amount: float) -> None:
        """``amount`` seconds of this context's queue executed."""
        if amount <= 0:
            return
        self.ran += amount
        self.period_ran += amount
        while amount > EPS and self.groups:
            head = self.groups[0]
            each = head[1]
            left = each - self.head_done
            if amount < left - EPS:
                self.head_done += amount
                amount = 0.0
                break
            amount -= left
            self.head_done = 0.0
            done = 1 + min(int(head[0]) - 1, int((amount + EPS) // each) if each > 0 else int(head[0]) - 1)
            amount -= (done - 1) * each
            head[0] -= done
            self.queued -= done
            if head[0] <= 0:
                self.groups.popleft()
        if not self.groups:
            self.queued, self.pending, self.head_done = 0, 0.0, 0.0
        else:
            self.pending = max(0.0, sum(c * e for c, e in self.groups) - self.head_done)

    def time_to_complete(self, launches: int) -> float:
        """GPU time until the first ``launches`` queued launches are done."""
        total, count = -self.head_done, 0
        for c, each in self.groups:
            take = min(int(c), launches - count)
            total += take * each
            count += take
            if count >= launches:
                break
        return max(0.0, total)
