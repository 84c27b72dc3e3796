"""Whether a simulated GPU can hold an allocation: its size, the client's MPS pinned
device-memory limit, and the driver's per-cgroup limits (a cgroup's limit covers every
process in it or below it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class OutOfMemory(Exception):
    """An allocation the GPU cannot hold (CUDA_ERROR_OUT_OF_MEMORY)."""


class Holder(Protocol):
    memory_bytes: int
    memory_limit: int | None
    cgroup: str


def check_allocation(
    ctx: Holder,
    nbytes: int,
    *,
    gpu: int,
    capacity: int,
    contexts: Sequence[Holder],
    cgroup_limits: Mapping[str, int],
) -> None:
    """Raise ``OutOfMemory`` when ``ctx`` may not allocate ``nbytes`` more."""
    used = sum(c.memory_bytes for c in contexts)
    if used + nbytes > capacity:
        raise OutOfMemory(
            f"out of memory on GPU {gpu}: {nbytes >> 20} MiB asked, {(capacity - used) >> 20} MiB free"
        )
    if ctx.memory_limit is not None and ctx.memory_bytes + nbytes > ctx.memory_limit:
        raise OutOfMemory(
            f"out of memory on GPU {gpu}: {nbytes >> 20} MiB asked, over the client's MPS "
            f"pinned device memory limit of {ctx.memory_limit >> 20} MiB ({ctx.memory_bytes >> 20} MiB held)"
        )
    for cgroup, limit in cgroup_limits.items():
        if not within(ctx.cgroup, cgroup):
            continue
        held = sum(c.memory_bytes for c in contexts if within(c.cgroup, cgroup))
        if held + nbytes > limit:
            raise OutOfMemory(
                f"out of memory on GPU {gpu}: {nbytes >> 20} MiB asked, over the driver's "
                f"memory limit of {limit >> 20} MiB for cgroup {cgroup} ({held >> 20} MiB held)"
            )


def within(path: str, root: str) -> bool:
    """``path`` is the cgroup ``root`` or one below it."""
    return bool(path) and (path == root or path.startswith(root.rstrip("/") + "/"))
