"""A simulated GPU node in virtual time, as the compute-cap loop sees a real one.

The GPU engines and CUDA programs of :mod:`agent.platform.gpu.sim.virtual`, with each
program standing for one container's only process, behind the interfaces the enforcer
uses on a node: NVML's samples (late, per sample period, only for processes that ran), the
device utilization, the sample period, pid → container, and an actuator whose freeze stops
the program (the work it queued keeps running on the GPU, as on a real one). Time is a
:class:`~agent.clock.VirtualClock`: every call first runs the node up to the clock, so a
control loop sleeping on that clock runs minutes of GPU time in a second of CPU.

Used by the controller's unit tests and the model benchmark (``bench/enforcement.py
--model``); what a container really got is the engine's ground truth (``gpu_seconds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.clock import VirtualClock
from agent.errors import PlatformError
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import DeviceSample, ProcessSample
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.programs import Program
from agent.platform.gpu.sim.virtual import VirtualNode, VirtualProcess


class Keyed(Protocol):
    """What the actuator is handed (a ThrottleTarget): its key is the container id."""

    @property
    def key(self) -> str: ...


@dataclass
class VirtualContainer:
    name: str
    ref: ContainerRef
    process: VirtualProcess
    freezes: list[tuple[float, bool]] = field(default_factory=list)  # (time, frozen)


class VirtualGpuNode:
    """GPUs, containers and the freezer in virtual time (see the module docstring)."""

    name = "virtual-freezer"

    def __init__(self, clock: VirtualClock, configs: Sequence[EngineConfig]) -> None:
        self.clock = clock
        # Wall time = monotonic time: VirtualClock gives both the same reading.
        self.node = VirtualNode(configs, start=clock.monotonic())
        self.containers: dict[str, VirtualContainer] = {}
        self._by_id: dict[str, VirtualContainer] = {}
        self._by_pid: dict[int, VirtualContainer] = {}
        self.fail_next: list[PlatformError] = []  # injected actuator errors, raised in order

    def sync(self) -> None:
        """Run the GPUs and programs up to the clock."""
        self.node.run_until(self.clock.monotonic())

    def add(
        self, name: str, gpu: int, program: Program, *, share: float = 1.0, mps_client: bool = False
    ) -> ContainerRef:
        self.sync()
        ref = ContainerRef(f"uid-{name}", f"cid-{name}")
        process = self.node.spawn(gpu, program, share=share, mps_client=mps_client)
        container = VirtualContainer(name, ref, process)
        self.containers[name] = self._by_id[ref.container_id] = container
        self._by_pid[container.process.pid] = container
        return ref

    # NVML's view (the enforcer's SampleSource) ---------------------------------------------
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        self.sync()  # the programs first: an engine run ahead alone would idle past their wake-ups
        samples = self.node.engines[index].samples(since_us, self.clock.monotonic())
        return [ProcessSample(s.pid, s.timestamp_us, s.sm_util) for s in samples]

    def device_utilization(self, index: int) -> int:
        self.sync()
        return self.node.engines[index].device_utilization(self.clock.monotonic())

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        self.sync()
        return self.node.engines[index].device_samples(since_us, self.clock.monotonic())

    def sample_period_s(self, index: int) -> float | None:
        return self.node.engines[index].config.sample_period_s

    def owner_of(self, pid: int) -> ContainerRef | None:
        container = self._by_pid.get(pid)
        return None if container is None else container.ref

    # The actuator ----------------------------------------------------------------------------
    def freeze(self, target: Keyed) -> None:
        self._set(target, True)

    def thaw(self, target: Keyed) -> None:
        self._set(target, False)

    def release(self, target: Keyed) -> None:
        self._set(target, False)

    def release_all(self) -> None:
        for container in self.containers.values():
            self._act(container, False)

    def _set(self, target: Keyed, frozen: bool) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)
        container = self._by_id.get(target.key)
        if container is not None and container.name in self.containers:
            self._act(container, frozen)

    def _act(self, container: VirtualContainer, frozen: bool) -> None:
        now = self.clock.monotonic()
        process = container.process
        if frozen and not process.frozen:
            self.node.freeze(process, now)
        elif not frozen and process.frozen:
            self.node.thaw(process, now)
        else:
            return
        container.freezes.append((now, frozen))

    # Ground truth ----------------------------------------------------------------------------
    def gpu_seconds(self, name: str) -> float:
        """GPU time the container's process executed so far (exact)."""
        self.sync()
        return self.containers[name].process.ctx.ran

    def frozen(self, name: str) -> bool:
        return self.containers[name].process.frozen

    def longest_freeze(self, name: str) -> float:
        longest, since = 0.0, None
        for at, frozen in self.containers[name].freezes:
            if frozen and since is None:
                since = at
            elif not frozen and since is not None:
                longest, since = max(longest, at - since), None
        if since is not None:
            longest = max(longest, self.clock.monotonic() - since)
        return longest
