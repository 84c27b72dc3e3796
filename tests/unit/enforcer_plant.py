"""A model GPU for driving the enforcer in virtual time.

Each container has one process with a demand ``b`` (the share of the GPU it uses when it
runs alone and unfrozen). Thawed containers share the GPU: when their demands add up to
more than 1 each gets its demand scaled down. Utilization is integrated exactly between
events (freeze, thaw, sampling), and samples are reported like NVML's: per process,
timestamped, optionally delivered ``lag_s`` late.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.clock import VirtualClock
from agent.control.actuators import ThrottleTarget
from agent.platform.cgroups.paths import ContainerRef
from agent.platform.gpu.inventory import ProcessSample


@dataclass
class ModelContainer:
    ref: ContainerRef
    pid: int
    demand: float
    frozen: bool = False
    busy_s: float = 0.0  # integrated GPU time
    freeze_log: list[tuple[float, bool]] = field(default_factory=list)


class ModelGpu:
    """One GPU (index 0); also the actuator (freezes act on the model)."""

    name = "model"

    def __init__(self, clock: VirtualClock, tick_s: float = 0.2, lag_s: float = 0.0) -> None:
        self.clock = clock
        self.tick_s = tick_s
        self.lag_s = lag_s
        self.containers: dict[str, ModelContainer] = {}
        self._last = clock.monotonic()
        self._last_tick = clock.monotonic()
        self._tick_busy: dict[int, float] = {}
        self._pending: list[ProcessSample] = []
        self.history: list[tuple[float, dict[str, float]]] = []  # (time, util per container) per tick

    def add(self, name: str, pid: int, demand: float) -> ContainerRef:
        ref = ContainerRef(f"uid-{name}", f"cid-{name}")
        self.advance()
        self.containers[name] = ModelContainer(ref, pid, demand)
        return ref

    def set_demand(self, name: str, demand: float) -> None:
        self.advance()
        self.containers[name].demand = demand

    def advance(self) -> None:
        now = self.clock.monotonic()
        while self._last_tick + self.tick_s <= now:
            self._integrate(self._last_tick + self.tick_s)
            self._emit_tick()
        self._integrate(now)

    def _integrate(self, until: float) -> None:
        dt = until - self._last
        if dt <= 0:
            return
        running = [c for c in self.containers.values() if not c.frozen]
        total = sum(c.demand for c in running)
        scale = 1.0 if total <= 1 else 1.0 / total
        for c in running:
            c.busy_s += c.demand * scale * dt
            self._tick_busy[c.pid] = self._tick_busy.get(c.pid, 0.0) + c.demand * scale * dt
        self._last = until

    def _emit_tick(self) -> None:
        self._last_tick += self.tick_s
        stamp = int(self._last_tick * 1_000_000)
        utils = {}
        for name, c in self.containers.items():
            util = 100 * self._tick_busy.get(c.pid, 0.0) / self.tick_s
            utils[name] = util
            if util > 0:  # NVML reports only processes that were active
                self._pending.append(ProcessSample(c.pid, stamp, round(util)))
        self.history.append((self._last_tick, utils))
        self._tick_busy = {}

    # SampleSource
    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        self.advance()
        cutoff = int((self.clock.monotonic() - self.lag_s) * 1_000_000)
        ready = [s for s in self._pending if s.timestamp_us <= cutoff and s.timestamp_us > since_us]
        self._pending = [s for s in self._pending if s.timestamp_us > cutoff]
        return ready

    def device_utilization(self, index: int) -> int:
        self.advance()
        if not self.history:
            return 0
        return round(sum(self.history[-1][1].values()))

    def owner_of(self, pid: int) -> ContainerRef | None:
        return next((c.ref for c in self.containers.values() if c.pid == pid), None)

    # Actuator
    def _container(self, target: ThrottleTarget) -> ModelContainer:
        return next(c for c in self.containers.values() if c.ref.container_id == target.key)

    def freeze(self, target: ThrottleTarget) -> None:
        self.advance()
        c = self._container(target)
        c.frozen = True
        c.freeze_log.append((self.clock.monotonic(), True))

    def thaw(self, target: ThrottleTarget) -> None:
        self.advance()
        c = self._container(target)
        c.frozen = False
        c.freeze_log.append((self.clock.monotonic(), False))

    def release(self, target: ThrottleTarget) -> None:
        self.thaw(target)

    def release_all(self) -> None:
        self.advance()
        for c in self.containers.values():
            c.frozen = False

    # Reading
    def mean_util(self, name: str, start: float, end: float) -> float:
        values = [u[name] for t, u in self.history if start < t <= end and name in u]
        return sum(values) / len(values) if values else 0.0

    def longest_freeze(self, name: str) -> float:
        longest, since = 0.0, None
        for t, frozen in self.containers[name].freeze_log:
            if frozen and since is None:
                since = t
            elif not frozen and since is not None:
                longest, since = max(longest, t - since), None
        return longest
