"""GPU memory quotas: how much a container uses, whether it is over, and who to blame.

Pure decisions over measured numbers; measuring is the platform's job (NVML or the simulator
per process, the ioctl tracer per (cgroup, pid)) and acting is the control layer's
(``agent.control.memguard``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.platform.procfs import ProcessIdentity

MIB = 1024 * 1024
# NV01_MEMORY_LOCAL_USER: video memory, the only RM_ALLOC class a quota ever refuses
# (system memory, virtual address spaces, channels... are not GPU memory the quota counts).
VIDEO_MEMORY_CLASS = 0x40


@dataclass(frozen=True)
class ProcessUse:
    """One process's GPU memory, as two independent sources measured it."""

    identity: ProcessIdentity
    nvml_bytes: int  # per-process memory from NVML (or the simulator)
    traced_bytes: int | None  # net video memory the ioctl tracer saw it allocate; None: no tracer
    last_alloc_ns: int | None  # when it last allocated (monotonic ns); None: unknown

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def used_bytes(self) -> int:
        """The larger of the two measures.

        NVML's per-process figure lags (the driver refreshes it, not each allocation) and
        misses allocations still in flight; the tracer sees the RM_ALLOC ioctl the moment
        it happens but misses what was allocated before it started or through paths it does
        not decode. Either source can miss memory but neither invents any, so the larger
        one is the better figure: taking it never counts less than either source saw.
        """
        return max(self.nvml_bytes, self.traced_bytes or 0)


@dataclass(frozen=True)
class QuotaVerdict:
    over: bool
    used_bytes: int  # the container's total
    quota_bytes: int
    culprit: ProcessUse | None  # the process to act on; None when under quota (or no process)
    reason: str  # a sentence for Events and logs


def format_mib(n_bytes: int) -> str:
    """``1500 MiB``, or one decimal when the bytes are not whole MiB."""
    mib = n_bytes / MIB
    return f"{mib:.0f} MiB" if n_bytes % MIB == 0 else f"{mib:.1f} MiB"


def _pick_culprit(processes: Sequence[ProcessUse]) -> tuple[ProcessUse, str] | None:
    holders = [p for p in processes if p.used_bytes > 0]
    if not holders:
        return None
    stamped = [p for p in holders if p.traced_bytes is not None and p.last_alloc_ns is not None]
    if stamped:
        # The allocation that crossed the line is the most recent one; ties go to the larger user.
        latest = max(stamped, key=lambda p: (p.last_alloc_ns or 0, p.used_bytes, -p.pid))
        return latest, "its allocation was the most recent (ioctl tracer)"
    largest = max(holders, key=lambda p: (p.used_bytes, -p.pid))
    return largest, "it holds the most GPU memory (no allocation times from the ioctl tracer)"


def judge(quota_mib: int, processes: Sequence[ProcessUse]) -> QuotaVerdict:
    """Is the container over ``quota_mib``, and which process went over?

    Over means strictly more than the quota: using exactly the quota is allowed, as in
    :func:`lsm_allows`. The culprit is the process whose allocation most recently pushed the
    total over, when the tracer says when each process allocated; otherwise the largest user.
    """
    quota_bytes = quota_mib * MIB
    used = sum(p.used_bytes for p in processes)
    if used <= quota_bytes:
        reason = f"GPU memory {format_mib(used)} is within the quota of {format_mib(quota_bytes)}"
        return QuotaVerdict(False, used, quota_bytes, None, reason)
    picked = _pick_culprit(processes)
    reason = f"GPU memory {format_mib(used)} exceeds the quota of {format_mib(quota_bytes)}"
    if picked is None:
        return QuotaVerdict(True, used, quota_bytes, None, reason)
    culprit, why = picked
    reason += f"; pid {culprit.pid} ({format_mib(culprit.used_bytes)}) was chosen because {why}"
    return QuotaVerdict(True, used, quota_bytes, culprit, reason)


def lsm_allows(quota_bytes: int, used_bytes: int, request_bytes: int, hclass: int) -> bool:
    """The `deny` mode's decision, exactly as ``allows()`` in bpf/memquota_lsm.c takes it.

    Only video memory (class 0x40) is ever refused, and only when the allocation would take
    the container strictly over its quota. Keep the two in step: the C program cannot be
    loaded on machines without BPF LSM, so this mirror is what the tests check.
    """
    if hclass != VIDEO_MEMORY_CLASS:
        return True
    return used_bytes + request_bytes <= quota_bytes


class AllocationTimes:
    """When each process last allocated video memory, from successive tracer totals.

    The tracer keeps running totals per process, not times; a process whose allocated total
    grew between two observations allocated in between, so it is stamped with the time of
    the observation that saw the growth (good to one check period).
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}  # pid -> (allocated bytes, stamp ns)

    def observe(self, allocated: Mapping[int, int], now_ns: int) -> dict[int, int]:
        """``allocated``: pid -> total video-memory bytes allocated so far (the tracer's
        ``vidmem_bytes_allocated``). Returns pid -> last allocation time, for processes that
        allocated anything; pids absent from ``allocated`` are forgotten."""
        seen: dict[int, tuple[int, int]] = {}
        for pid, total in allocated.items():
            before = self._seen.get(pid)
            if before is not None and total <= before[0]:
                seen[pid] = (total, before[1])  # a total can shrink only if the tracer forgot it
            elif total > 0:
                seen[pid] = (total, now_ns)
        self._seen = seen
        return {pid: stamp for pid, (_, stamp) in seen.items()}
