"""One node's GPUs as the scheduler extender sees them: usage, fit, GPU choice, node score.

Fit rules (docs/extender.md, "Fit"):

- A share (vcuda-core < 100) fits one healthy GPU that has both its cores and its MiB
  free and runs fewer than ``max_per_gpu`` containers.
- A multiple of 100 takes that many healthy GPUs with nothing on them (0 cores,
  0 MiB, 0 containers), with all their memory; a ``vcuda-memory`` given with it must
  be at most the chosen GPUs' schedulable MiB together. Among the possible sets the
  best-linked one wins (``agent.domain.wholegpus``: NVLink first).
- App containers of a pod are placed together: whole-GPU containers first, then
  shares from the largest down, each on what the previous ones left.
- Init containers run one at a time before the app containers and kubelet passes
  their devices on to the app containers, so each must fit the node on its own
  (against the node's usage, not the pod's app containers) and none is charged.
- Containers whose GPU is not known yet (bound by another scheduler, not allocated
  by the agent yet) are "pending": they hold cores, MiB and (for whole-GPU
  containers) empty GPUs of the node as a whole, so a pod also needs the node's
  totals to cover it plus every pending container.

The GPU policy picks among the GPUs a share fits: binpack takes the one with the
fewest free cores (then fewest free MiB, then lowest index), spread the most free.
Filtering uses binpack (the order most likely to fit several containers); a
reservation tries its own policy first and falls back to binpack, so a node that
passed the filter also passes the reservation when nothing changed in between.

``NodeState`` keeps summaries (the free cores/MiB of the GPUs that can take
another share, the largest of each, the empty GPUs, node totals), recomputed only
after a change, so one share is accepted or rejected after a glance at them.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.domain.nodeinventory import NodeInventory
from agent.domain.placement import link_score
from agent.domain.schedrequest import ContainerDemand, PackPolicy, PodDemand
from agent.domain.wholegpus import best_set

GpuKey = tuple[bool, int]  # ContainerDemand.key
Placement = dict[GpuKey, tuple[int, ...]]
Share = tuple[int, int, int]  # (free cores, free MiB, GPU index) of a GPU that can take one more share
_SET_CACHE = 256  # whole-GPU choices remembered per node


class GpuState:
    """One GPU: capacity from the inventory, usage from the charges."""

    __slots__ = ("containers", "cores", "healthy", "index", "memory", "used_cores", "used_memory")

    def __init__(self, index: int, cores: int, memory: int, healthy: bool) -> None:
        self.index, self.cores, self.memory, self.healthy = index, cores, memory, healthy
        self.used_cores = self.used_memory = self.containers = 0

    @property
    def empty(self) -> bool:
        used = self.used_cores or self.used_memory or self.containers
        return self.healthy and self.cores > 0 and not used  # 0 cores: a GPU in MIG mode


class NodeState:
    """Usage and summaries of one node; ``inventory`` None means not eligible (``problem`` says why)."""

    def __init__(self, name: str, inventory: NodeInventory | None, problem: str) -> None:
        self.name = name
        self.inventory = inventory
        self.problem = problem
        self.gpus: dict[int, GpuState] = {}
        self.links: dict[tuple[int, int], int] = {}  # link score per ordered GPU pair
        self.memory: dict[int, int] = {}  # schedulable MiB per GPU
        if inventory is not None:
            for g in inventory.gpus:
                # A GPU serving isolated shares on demand takes no other share (isolatedfit.py).
                plain = g.mig is None or not g.mig.on_demand
                cores, memory = (g.cores, g.schedulable_mib) if plain else (0, 0)
                self.gpus[g.index] = GpuState(g.index, cores, memory, g.healthy)
            self.memory = {i: s.memory for i, s in self.gpus.items()}
            self.links = {
                (g.index, peer): link_score(link) for g in inventory.gpus for peer, link in g.links.items()
            }
        self.heartbeat = inventory.heartbeat if inventory is not None else 0.0
        self.pending_cores = self.pending_memory = self.pending_whole = self.pending_containers = 0
        self.dirty = True
        self.max_per_gpu = 0
        self.shares: list[Share] = []
        self.rooms: list[int] = []  # containers each of ``shares`` may still take
        self.free_cores = 0  # free cores of ``shares`` together
        self._memo: tuple[PodDemand, Placement | None, str] | None = None
        self._quick: tuple[tuple[tuple[int, int, int], ...], bool | None] | None = None
        self.max_cores = self.max_memory = 0
        self.empty: list[int] = []
        self.blocked: list[str] = []  # why healthy-looking capacity is out of reach, per GPU
        self.healthy_cores = self.healthy_memory = self.used_cores = self.used_memory = 0
        self.largest_memory = 0  # schedulable MiB of the largest healthy GPU
        self.gpu_memory = 0  # average schedulable MiB of a healthy GPU
        self._sets: dict[tuple[tuple[int, ...], int, int], tuple[int, ...] | None] = {}

    def refresh(self, max_per_gpu: int) -> None:
        """Recompute the summaries after charges changed (cheap: one pass over the GPUs)."""
        self.max_per_gpu = max_per_gpu
        healthy = [g for g in self.gpus.values() if g.healthy]
        self.shares = [
            (g.cores - g.used_cores, g.memory - g.used_memory, g.index)
            for g in healthy
            if g.containers < max_per_gpu
        ]
        self.rooms = [max_per_gpu - self.gpus[s[2]].containers for s in self.shares]
        self.free_cores = sum(max(s[0], 0) for s in self.shares)
        self._memo = self._quick = None
        self.max_cores = max((s[0] for s in self.shares), default=0)
        self.max_memory = max((s[1] for s in self.shares), default=0)
        self.empty = [g.index for g in healthy if g.empty]
        self.blocked = [f"GPU {g.index} is unhealthy" for g in self.gpus.values() if not g.healthy]
        self.blocked += [
            f"GPU {g.index} already runs {g.containers} containers (the limit)"
            for g in healthy
            if g.containers >= max_per_gpu
        ]
        self.healthy_cores = sum(g.cores for g in healthy)
        self.healthy_memory = sum(g.memory for g in healthy)
        self.used_cores = sum(g.used_cores for g in healthy)
        self.used_memory = sum(g.used_memory for g in healthy)
        self.largest_memory = max((g.memory for g in healthy), default=0)
        self.gpu_memory = self.healthy_memory // max(1, len(healthy))
        self.dirty = False

    # -- fit -----------------------------------------------------------------

    def fit(self, demand: PodDemand, policy: PackPolicy) -> tuple[Placement | None, str]:
        """(GPUs per container, "") if the pod fits now, else (None, reason). Call refresh first."""
        placement: Placement = {}
        for c in demand.containers:
            if c.init:  # each on its own, against the node's usage
                chosen, reason = self._place_alone(c, policy)
                if chosen is None:
                    return None, reason
                placement[c.key] = chosen
        apps = [c for c in demand.containers if not c.init]
        if len(apps) == 1 and not self.pending_containers:
            chosen, reason = self._place_alone(apps[0], policy)
            if chosen is None:
                return None, reason
            placement[apps[0].key] = chosen
            return placement, ""
        if apps:
            reason = self._place_together(apps, policy, placement)
            if reason:
                return None, reason
        return placement, ""

    def fits_quickly(self, shape: Shape) -> bool | None:
        """True/False from the summaries alone, for most pods; None = call ``fit``. A True here
        means any greedy placement succeeds (so ``fit`` with either policy does too)."""
        if self.pending_containers:
            return None
        memo = self._quick
        if memo is not None and memo[0] == shape.key:  # prioritize right after filter
            return memo[1]
        found = self._fits_quickly(shape)
        self._quick = (shape.key, found)
        return found

    def _fits_quickly(self, shape: Shape) -> bool | None:
        if shape.single_share:  # the common pod, inline: this runs for every node
            cores, memory = shape.top_cores, shape.top_memory
            if self.max_cores < cores or self.max_memory < memory:
                return False
            for s in self.shares:  # noqa: SIM110 (a loop beats any() over a generator here)
                if s[0] >= cores and s[1] >= memory:
                    return True
            return False
        for cores, memory, whole in shape.inits:
            alone = self._alone_quickly(cores, memory, whole)
            if alone is not True:
                return alone
        if len(shape.apps) == 1:
            return self._alone_quickly(*shape.apps[0])
        if not shape.apps:
            return True
        if not shape.shares_only:
            return None
        top_cores, top_memory = shape.top_cores, shape.top_memory
        if self.max_cores < top_cores or self.max_memory < top_memory or shape.total_cores > self.free_cores:
            return False
        # Fits if one GPU takes the whole pod, or each container can have a GPU to itself:
        # either way no greedy order can paint itself into a corner.
        count, total_cores, total_memory = len(shape.apps), shape.total_cores, shape.total_memory
        able = 0
        for (free_cores, free_memory, _), room in zip(self.shares, self.rooms, strict=True):
            if free_cores >= total_cores and free_memory >= total_memory and room >= count:
                return True
            if free_cores >= top_cores and free_memory >= top_memory:
                able += 1
        return True if able >= count else None

    def _alone_quickly(self, cores: int, memory: int, whole: int) -> bool:
        if whole:
            if len(self.empty) < whole:
                return False
            if not memory:
                return True
            sizes = sorted((self.gpus[i].memory for i in self.empty), reverse=True)
            return sum(sizes[:whole]) >= memory
        if self.max_cores < cores or self.max_memory < memory:
            return False
        return any(s[0] >= cores and s[1] >= memory for s in self.shares)

    def check(self, demand: PodDemand) -> tuple[Placement | None, str]:
        """``fit`` with binpack (the filter's question), remembered until the node changes so
        that prioritize after filter, or the same pod asked again, costs nothing."""
        memo = self._memo
        if memo is not None and (memo[0] is demand or memo[0] == demand):
            return memo[1], memo[2]
        placement, reason = self.fit(demand, PackPolicy.BINPACK)
        self._memo = (demand, placement, reason)
        return placement, reason

    def _place_alone(self, c: ContainerDemand, policy: PackPolicy) -> tuple[tuple[int, ...] | None, str]:
        if c.whole:
            chosen = self._whole_set(self.empty, c)
            return (chosen, "") if chosen is not None else (None, self._whole_reason(c, self.empty))
        if self.max_cores >= c.cores and self.max_memory >= c.memory_mib:
            index = choose_share(self.shares, c, policy)
            if index is not None:
                return (index,), ""
        return None, self._share_reason(c, self.shares, self.blocked)

    def _place_together(self, apps: list[ContainerDemand], policy: PackPolicy, placement: Placement) -> str:
        # Work on copies: wholes first (they need empty GPUs), then shares largest first.
        free = {s[2]: [s[0], s[1], self.gpus[s[2]].containers] for s in self.shares}
        empty = list(self.empty)
        blocked = list(self.blocked)
        order = sorted(apps, key=lambda c: (not c.whole, -c.cores, -c.memory_mib, c.index))
        cores = memory = 0
        for c in order:
            if c.whole:
                chosen = self._whole_set(empty, c)
                if chosen is None:
                    return self._whole_reason(c, empty)
                for i in chosen:
                    empty.remove(i)
                    del free[i]
                    cores += self.gpus[i].cores
                    memory += self.gpus[i].memory
                placement[c.key] = chosen
                continue
            shares = [(f[0], f[1], i) for i, f in free.items()]
            index = choose_share(shares, c, policy)
            if index is None:
                reason = self._share_reason(c, shares, blocked)
                return f"{reason} (after placing the pod's other containers)" if len(apps) > 1 else reason
            slot = free[index]
            slot[0] -= c.cores
            slot[1] -= c.memory_mib
            slot[2] += 1
            if slot[2] >= self.max_per_gpu:
                del free[index]
                blocked.append(f"GPU {index} would run {slot[2]} containers (the limit)")
            if index in empty:
                empty.remove(index)
            cores += c.cores
            memory += c.memory_mib
            placement[c.key] = (index,)
        return self._pending_reason(cores, memory, len(empty)) if self.pending_containers else ""

    def _pending_reason(self, cores: int, memory: int, empty_left: int) -> str:
        free_cores = self.healthy_cores - self.used_cores - self.pending_cores
        free_memory = self.healthy_memory - self.used_memory - self.pending_memory
        if cores <= free_cores and memory <= free_memory and empty_left >= self.pending_whole:
            return ""
        held = (
            f"{self.pending_containers} container(s) on this node have no GPU assigned yet "
            f"({self.pending_cores} vcuda-core, {self.pending_memory} MiB"
            + (f", {self.pending_whole} whole GPUs" if self.pending_whole else "")
            + ")"
        )
        if empty_left < self.pending_whole:
            return f"{held}: they need {self.pending_whole} empty GPUs, {empty_left} would be left"
        return (
            f"{held}: with them counted the node has {max(free_cores, 0)} vcuda-core and "
            f"{max(free_memory, 0)} MiB free in total, the pod needs {cores} and {memory}"
        )

    # -- whole GPUs ------------------------------------------------------------

    def _whole_set(self, empty: Sequence[int], c: ContainerDemand) -> tuple[int, ...] | None:
        # Ranking sets costs up to thousands of steps; the same free GPUs recur, so remember.
        key = (tuple(empty), c.gpu_count, c.memory_mib)
        if key in self._sets:
            return self._sets[key]
        if len(self._sets) >= _SET_CACHE:
            self._sets.clear()
        chosen = self._sets[key] = best_set(empty, c.gpu_count, c.memory_mib, self.memory, self.links)
        return chosen

    # -- reasons -----------------------------------------------------------------

    def _whole_reason(self, c: ContainerDemand, empty: Sequence[int]) -> str:
        where = f"{'init container' if c.init else 'container'} {c.name}: "
        count = c.gpu_count
        healthy = sum(1 for g in self.gpus.values() if g.healthy)
        if len(empty) >= count:  # enough empty GPUs, too little memory together
            biggest = sorted((self.gpus[i].memory for i in empty), reverse=True)[:count]
            return (
                f"{where}{count} whole GPUs with {c.memory_mib} MiB together needed; the "
                f"{count} largest free GPUs have {sum(biggest)} MiB"
            )
        listing = ", ".join(map(str, sorted(empty)))
        detail = [f"GPU {listing} free" if len(empty) == 1 else f"GPUs {listing} free"] if empty else []
        busy = healthy - len(empty)
        if busy:
            detail.append(f"{busy} healthy GPU(s) partly used")
        unhealthy = len(self.gpus) - healthy
        if unhealthy:
            detail.append(f"{unhealthy} unhealthy")
        suffix = f" ({'; '.join(detail)})" if detail else ""
        noun = "GPU" if count == 1 else "GPUs"
        return f"{where}{count} whole {noun} needed, {len(empty)} free{suffix}"

    def _share_reason(self, c: ContainerDemand, shares: Sequence[Share], blocked: Sequence[str]) -> str:
        where = f"{'init container' if c.init else 'container'} {c.name}: "
        if not self.gpus:
            return "the node's inventory lists no GPUs"
        if not shares:
            return f"{where}no GPU can take another container: " + "; ".join(blocked)
        if c.memory_mib > self.largest_memory:
            return (
                f"{where}needs {c.memory_mib} MiB on one GPU, but the largest healthy GPU here has "
                f"{self.largest_memory} MiB schedulable (nvidia.com/vcuda-memory counts MiB)"
            )
        best = max(shares, key=lambda s: ((s[0] >= c.cores) + (s[1] >= c.memory_mib), s[0], s[1], -s[2]))
        reason = (
            f"{where}no GPU has {c.cores} vcuda-core and {c.memory_mib} MiB free together "
            f"(best: GPU {best[2]} with {best[0]} cores and {best[1]} MiB free)"
        )
        total = sum(max(s[0], 0) for s in shares)
        if total >= c.cores > best[0]:
            reason += (
                f"; the node's {total} free vcuda-core are split across GPUs and a share must fit one GPU"
            )
        if blocked:
            reason += "; " + "; ".join(blocked)
        return reason

    # -- score ---------------------------------------------------------------------

    def score(self, shape: Shape, spread: bool) -> int:
        """1..10 for a node the pod fits: how full the node is after placing it (binpack) or
        how empty (spread). Cores weigh three times as much as MiB, so nodes with equal core
        use are told apart by memory. Init containers are not counted (they are not charged)."""
        if not self.healthy_cores:
            return 1
        memory = shape.total_memory
        if shape.whole_gpus:  # a whole GPU takes all its memory: count an average GPU's
            memory = max(memory, shape.share_memory + shape.whole_gpus * self.gpu_memory)
        core_fill = (self.used_cores + self.pending_cores + shape.total_cores) / self.healthy_cores
        memory_fill = (self.used_memory + self.pending_memory + memory) / (self.healthy_memory or 1)
        fill = (3 * core_fill + memory_fill) / 4
        fill = 0.0 if fill < 0.0 else 1.0 if fill > 1.0 else fill
        return 1 + round(9 * (1.0 - fill if spread else fill))


class Shape:
    """What the per-node checks need from a pod, computed once per request (not per node)."""

    def __init__(self, demand: PodDemand) -> None:
        def part(c: ContainerDemand) -> tuple[int, int, int]:
            return (c.cores, c.memory_mib, c.gpu_count if c.whole else 0)

        apps = [c for c in demand.containers if not c.init]
        self.inits = [part(c) for c in demand.containers if c.init]
        self.apps = [part(c) for c in apps]
        self.shares_only = not any(c.whole for c in apps)
        self.single_share = not self.inits and len(apps) == 1 and self.shares_only
        self.key = (*self.inits, (-1, -1, -1), *self.apps)  # equal keys, equal quick answers
        self.top_cores = max((c.cores for c in apps), default=0)
        self.top_memory = max((c.memory_mib for c in apps), default=0)
        self.total_cores = sum(c.cores for c in apps)
        self.total_memory = sum(c.memory_mib for c in apps)
        self.whole_gpus = sum(c.gpu_count for c in apps if c.whole)
        self.share_memory = sum(c.memory_mib for c in apps if not c.whole)


def choose_share(shares: Sequence[Share], c: ContainerDemand, policy: PackPolicy) -> int | None:
    """The GPU index for a share, or None when none fits (see the module docstring)."""
    cores, memory = c.cores, c.memory_mib
    fits = [s for s in shares if s[0] >= cores and s[1] >= memory]
    if not fits:
        return None
    if policy is PackPolicy.SPREAD:
        return min(fits, key=lambda s: (-s[0], -s[1], s[2]))[2]
    return min(fits)[2]
