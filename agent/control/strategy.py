"""How the compute-cap loop holds the containers of one GPU: the interface of a strategy.

The enforcer (:mod:`agent.control.enforcer`) owns the containers (their cgroups, the
actuator, whether each is frozen) and, each period, picks one strategy per GPU:

- *turns* (:class:`~agent.control.turnloop.TurnLoop`) where the GPU time-slices and has
  device samples: held containers take turns, one thawed at a time, measured by the device
  samples through the agent's own record of whom it kept thawed when;
- *duty cycles* (:class:`~agent.control.dutyloop.DutyLoop`) where its clients run
  concurrently (MPS), where the driver has no device samples, and with
  ``--control-feedback nvml``: each held container thawed for a duty of a common cycle,
  measured by NVML's per-process samples.

A strategy owns what it decides: each container's target (``goal``) and reading (``used``),
who is held, who yields, and the freezes and thaws that follow; the enforcer does them and
reports back. One period, for each strategy and its GPUs:

1. :meth:`GpuStrategy.read` the GPUs' new samples (a GPU that changed strategy since the
   last period is first let go by the old one, :meth:`~GpuStrategy.reset`, and taken over
   by the new one, :meth:`~GpuStrategy.take_over`);
2. per GPU, :meth:`~GpuStrategy.stale` (the enforcer releases everything on stale
   readings and calls :meth:`~GpuStrategy.reset`), else :meth:`~GpuStrategy.update`:
   the containers it acts on, of which :meth:`~GpuStrategy.held` are held (the rest yield);
3. :meth:`~GpuStrategy.schedule` with the held containers the enforcer can act on;
4. until the next period, :meth:`~GpuStrategy.due` hands out the freezes and thaws at their
   times (:meth:`~GpuStrategy.next_time`: when the next one is), and the enforcer tells every
   strategy what it did (:meth:`~GpuStrategy.acted`: the turns' record is kept on every GPU,
   so that a GPU that changes strategy is read from its true history).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agent.control.containers import ContainerControl, GpuView

Action = tuple[int, ContainerControl, bool]  # (GPU, container, thaw? else freeze)


class GpuStrategy(Protocol):
    """One way of holding containers to their targets (one control loop's, not thread-safe)."""

    name: str  # for logs and status: "turns", "duty cycles"

    @property
    def errors(self) -> int:
        """Failed reads so far (metrics)."""
        ...

    def read(self, gpus: Sequence[int], index: int, start: float) -> None:
        """Period ``index`` starts at ``start`` (monotonic): take in the new samples of ``gpus``."""
        ...

    def stale(self, gpu: int) -> str | None:
        """Why the GPU's readings cannot be acted on now (None: they can)."""
        ...

    def read_every(self, gpu: int) -> int:
        """The GPU is read and its holds decided every this many periods (1: every one)."""
        ...

    def reset(self, gpu: int) -> None:
        """Its containers were released (stale readings), or another strategy holds the GPU
        now: nothing of this one's is due there until it is asked again."""
        ...

    def take_over(self, gpu: int) -> None:
        """The GPU comes to this strategy from another: whatever it kept for the GPU (accounts,
        plans) is from before, and the samples since are of a time it did not hold it."""
        ...

    def update(self, gpu: int, controls: Sequence[ContainerControl]) -> list[ContainerControl]:
        """Targets, readings and who is held; the containers to act on (the rest released)."""
        ...

    def held(self, gpu: int) -> set[str]:
        """The keys of the held containers (those acted on but not held yield)."""
        ...

    def view(self, gpu: int, stale: str | None, controls: Sequence[ContainerControl]) -> GpuView:
        """The GPU's figures for status and metrics."""
        ...

    def schedule(self, gpu: int, held: Sequence[ContainerControl], index: int, start: float) -> None:
        """The held containers the enforcer can act on, in period ``index`` from ``start``."""
        ...

    def next_time(self) -> float:
        """When an action is due next (monotonic; inf: none)."""
        ...

    def due(self, now: float) -> list[Action]:
        """The actions due by ``now``, earliest first (freezes before thaws at one time)."""
        ...

    def acted(self, gpu: int, control: ContainerControl, thawed: bool, at: float) -> None:
        """The enforcer thawed (or froze) ``control`` at ``at``."""
        ...

    def measured(self, gpu: int, key: str) -> bool:
        """Whether the container's reading is measured, not merely 0."""
        ...

    def forget(self, gpu: int, key: str) -> None:
        """The container is gone (or left the GPU)."""
        ...
