"""CUDA's blocking rules for a call that cannot return at once: a launch into a full queue
(it returns once all its launches are queued) and a sync (it returns once the queue is
empty). The GPU server and the virtual driver both wait through these."""

from __future__ import annotations

from dataclasses import dataclass

from agent.platform.gpu.sim.context import Context
from agent.platform.gpu.sim.engine import GpuEngine


@dataclass
class BlockedCall:
    """A launch with ``left`` launches of ``each_s`` still to queue, or a sync (``sync``)."""

    sync: bool = False
    left: int = 0
    each_s: float = 0.0

    def progress(self, engine: GpuEngine, ctx: Context, now: float) -> bool:
        """Move the call on at ``now``: True when it may return."""
        if self.sync:
            engine.advance(now)
            return ctx.queued == 0
        self.left -= engine.submit(ctx, self.left, self.each_s, now)
        return self.left <= 0

    def awaits(self, engine: GpuEngine, ctx: Context) -> int:
        """How many queued launches must complete before the call can move on."""
        if self.sync:
            return ctx.queued
        depth = engine.config.queue_depth
        # Room for a chunk, not for all that is left: a launch larger than the queue tops it
        # up as it drains, as the driver does, instead of waiting for it to empty.
        chunk = min(self.left, max(1, depth // 16))
        return max(1, min(ctx.queued, ctx.queued + chunk - depth))
