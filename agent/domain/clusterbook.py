"""The scheduler extender's book of the cluster: nodes' GPUs, the pods charged to them,
fit, scores and reservations. Pure and NOT thread-safe: the caller serialises access.

- Nodes come from their ``nvidia.com/vcuda-inventory`` annotation. A node is eligible
  only with a readable inventory whose heartbeat is at most ``stale_after_s`` old
  (the agent re-writes it every 30 s; an older one means the agent is not running).
- Charges are pods that hold GPUs: placed pods read from the API (their predicate
  annotations name the GPUs) and reservations made by ``reserve`` for a bind. A GPU
  container without known GPUs is "pending" and counts against its node's totals
  (see ``gpufit``). Init containers are never charged (``gpufit`` says why).
- Charges survive node updates and may name nodes not seen yet: every node's usage
  is rebuilt from its charges whenever its GPUs change.

Fit and scores per node are in ``agent.domain.gpufit``; for pods asking for hardware-isolated
shares (``nvidia.com/vcuda-isolation: mig``) in ``agent.domain.isolatedfit``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.domain.gpufit import GpuKey, NodeState, Placement, Shape
from agent.domain.isolatedfit import isolated_fit
from agent.domain.nodeinventory import INVENTORY_ANNOTATION, NodeInventory
from agent.domain.schedrequest import DEFAULT_MAX_PER_GPU, PackPolicy, PodDemand
from agent.errors import VcudaError

__all__ = ["Assignment", "ClusterBook", "GpuKey", "GpuUsage", "NoFitError"]

UNKNOWN_NODE = "the extender has not seen this node yet (its node cache may still be filling)"


class NoFitError(VcudaError):
    """The pod does not fit the node; str(err) is the reason."""


@dataclass(frozen=True)
class Assignment:
    node: str
    gpus: Mapping[GpuKey, tuple[int, ...]]  # GPU indexes per GPU container


@dataclass(frozen=True)
class GpuUsage:
    index: int
    cores_used: int
    cores_total: int
    memory_used_mib: int
    memory_total_mib: int  # schedulable MiB
    containers: int
    healthy: bool


@dataclass(frozen=True)
class _Charge:
    node: str
    demand: PodDemand
    gpus: Mapping[GpuKey, tuple[int, ...]]


class ClusterBook:
    def __init__(self, *, max_per_gpu: int = DEFAULT_MAX_PER_GPU, stale_after_s: float = 90.0) -> None:
        self.max_per_gpu = max_per_gpu
        self.stale_after_s = stale_after_s
        self._nodes: dict[str, NodeState] = {}
        self._charges: dict[str, _Charge] = {}
        self._by_node: dict[str, set[str]] = {}  # node -> uids charged there

    # -- nodes -----------------------------------------------------------------

    def set_node(self, name: str, inventory: NodeInventory | None, problem: str = "") -> None:
        """Add or update a node. ``inventory`` None: known but not eligible, ``problem`` says why
        (shown in FailedNodes). Charges on the node are kept across updates."""
        if inventory is None and not problem:
            problem = f"not managed: no {INVENTORY_ANNOTATION} annotation"
        old = self._nodes.get(name)
        if (
            old is not None
            and inventory is not None
            and old.inventory is not None
            and old.inventory.gpus == inventory.gpus
        ):
            old.inventory, old.heartbeat, old.problem = inventory, inventory.heartbeat, problem
            return  # a heartbeat: same GPUs, usage unchanged
        state = NodeState(name, inventory, problem)
        self._nodes[name] = state
        for uid in self._by_node.get(name, ()):
            self._apply(state, self._charges[uid], +1)

    def remove_node(self, name: str) -> None:
        self._nodes.pop(name, None)  # its charges stay: the pods' own deletions remove them

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    # -- charges -----------------------------------------------------------------

    def charge(self, uid: str, node: str, demand: PodDemand, gpus: Mapping[GpuKey, tuple[int, ...]]) -> None:
        """Record that pod ``uid`` holds ``gpus`` on ``node``; replaces an earlier charge of ``uid``.
        A GPU container missing from ``gpus`` is pending (on the node, GPU not known yet)."""
        self.uncharge(uid)
        charge = _Charge(node, demand, dict(gpus))
        self._charges[uid] = charge
        self._by_node.setdefault(node, set()).add(uid)
        state = self._nodes.get(node)
        if state is not None:
            self._apply(state, charge, +1)

    def uncharge(self, uid: str) -> None:
        charge = self._charges.pop(uid, None)
        if charge is None:
            return
        uids = self._by_node.get(charge.node)
        if uids is not None:
            uids.discard(uid)
            if not uids:
                del self._by_node[charge.node]
        state = self._nodes.get(charge.node)
        if state is not None:
            self._apply(state, charge, -1)

    def charge_of(self, uid: str) -> Assignment | None:
        charge = self._charges.get(uid)
        return None if charge is None else Assignment(charge.node, charge.gpus)

    def _apply(self, state: NodeState, charge: _Charge, sign: int) -> None:
        # The same inputs give the same parts, so -1 undoes +1 exactly on an unchanged node
        # (a node whose GPUs change is rebuilt from scratch instead).
        for c in charge.demand.containers:
            if c.init:
                continue
            indexes = charge.gpus.get(c.key)
            gpus = [state.gpus.get(i) for i in indexes or ()]
            if not gpus or any(g is None for g in gpus) or (not c.whole and len(gpus) != 1):
                state.pending_cores += sign * c.cores
                state.pending_memory += sign * c.memory_mib
                state.pending_whole += sign * (c.gpu_count if c.whole else 0)
                state.pending_containers += sign
                continue
            for g in gpus:
                assert g is not None  # checked above; for mypy
                g.used_cores += sign * (g.cores if c.whole else c.cores)
                g.used_memory += sign * (g.memory if c.whole else c.memory_mib)
                g.containers += sign
        state.dirty = True

    # -- scheduling ------------------------------------------------------------------

    def _eligible(self, name: str, now: float) -> tuple[NodeState | None, str]:
        state = self._nodes.get(name)
        if state is None or state.inventory is None or now - state.heartbeat > self.stale_after_s:
            return None, self._ineligible(name, now)
        if state.dirty:
            state.refresh(self.max_per_gpu)
        return state, ""

    def _ineligible(self, name: str, now: float) -> str:
        state = self._nodes.get(name)
        if state is None:
            return UNKNOWN_NODE
        if state.inventory is None:
            return state.problem
        return (
            f"inventory heartbeat is {now - state.heartbeat:.0f} s old (stale after "
            f"{self.stale_after_s:.0f} s): is vcuda-agent running on the node?"
        )

    def _fitting(self, demand: PodDemand, nodes: Sequence[str], now: float) -> list[NodeState | None]:
        """Per name, its state if the pod fits there now, else None (the hot loop, kept lean)."""
        shape = Shape(demand)
        get, stale, max_per_gpu = self._nodes.get, self.stale_after_s, self.max_per_gpu
        found: list[NodeState | None] = []
        for name in nodes:
            state = get(name)
            if state is None or state.inventory is None or now - state.heartbeat > stale:
                found.append(None)
                continue
            if state.dirty:
                state.refresh(max_per_gpu)
            quick = state.fits_quickly(shape)
            if quick is None:
                quick = state.check(demand)[0] is not None
            found.append(state if quick else None)
        return found

    def filter(
        self, demand: PodDemand, nodes: Sequence[str], now: float, *, isolated: bool = False
    ) -> tuple[list[str], dict[str, str]]:
        """(nodes that fit, in the given order; {node: reason} for the others). ``now`` is wall time.
        ``isolated``: the pod asks for hardware-isolated shares (``isolatedfit``)."""
        if isolated:
            return self._filter_isolated(demand, nodes, now)
        fit: list[str] = []
        failed: dict[str, str] = {}
        for name, state in zip(nodes, self._fitting(demand, nodes, now), strict=True):
            if state is not None:
                fit.append(name)
                continue
            eligible, reason = self._eligible(name, now)
            if eligible is not None:  # the reason is worth its cost only for nodes that failed
                reason = eligible.check(demand)[1]
            failed[name] = reason
        return fit, failed

    def prioritize(
        self,
        demand: PodDemand,
        nodes: Sequence[str],
        now: float,
        node_policy: PackPolicy,
        gpu_policy: PackPolicy,
        *,
        isolated: bool = False,
    ) -> dict[str, int]:
        """Score 0..10 for every node in ``nodes``: 0 where the pod does not fit, else 1..10
        (``NodeState.score``). The pod's own policy annotations win over the arguments (the
        extender's defaults). ``gpu_policy`` does not change scores, only which GPUs reserve picks."""
        if isolated:  # every node where it fits alike: the instances are the pod's alone
            passed, _ = self._filter_isolated(demand, nodes, now)
            return {name: 10 if name in passed else 0 for name in nodes}
        spread = (demand.node_policy or node_policy) is PackPolicy.SPREAD
        shape = Shape(demand)
        return {
            name: 0 if state is None else state.score(shape, spread)
            for name, state in zip(nodes, self._fitting(demand, nodes, now), strict=True)
        }

    def reserve(
        self,
        uid: str,
        node: str,
        demand: PodDemand,
        gpu_policy: PackPolicy,
        now: float,
        *,
        isolated: bool = False,
    ) -> Assignment:
        """Choose GPUs on ``node`` (the pod's GPU policy annotation wins over ``gpu_policy``) and
        charge them to ``uid`` in one step; NoFitError(reason) when the pod does not fit now.
        Reserving again for the same uid replaces its earlier charge (kept if this one fails)."""
        previous = self._charges.get(uid)
        if previous is not None:
            self.uncharge(uid)
        try:
            if isolated:
                placement = self._choose_isolated(node, demand, now)
            else:
                placement = self._choose(node, demand, demand.gpu_policy or gpu_policy, now)
        except NoFitError:
            if previous is not None:
                self.charge(uid, previous.node, previous.demand, previous.gpus)
            raise
        self.charge(uid, node, demand, placement)
        return Assignment(node, placement)

    def _choose(self, node: str, demand: PodDemand, policy: PackPolicy, now: float) -> Placement:
        state, reason = self._eligible(node, now)
        if state is None:
            raise NoFitError(reason)
        if policy is PackPolicy.BINPACK:
            placement, reason = state.check(demand)
        else:
            placement, reason = state.fit(demand, policy)
            if placement is None:  # the filter's order may still fit it
                placement, _ = state.check(demand)
        if placement is None:
            raise NoFitError(reason)
        return dict(placement)  # the memo's copy stays untouched

    def _filter_isolated(
        self, demand: PodDemand, nodes: Sequence[str], now: float
    ) -> tuple[list[str], dict[str, str]]:
        fit: list[str] = []
        failed: dict[str, str] = {}
        for name in nodes:
            state, reason = self._eligible(name, now)
            if state is not None and state.inventory is not None:
                placement, reason = isolated_fit(state.inventory, demand)
                if placement is not None:
                    fit.append(name)
                    continue
            failed[name] = reason
        return fit, failed

    def _choose_isolated(self, node: str, demand: PodDemand, now: float) -> Placement:
        state, reason = self._eligible(node, now)
        if state is None or state.inventory is None:
            raise NoFitError(reason)
        placement, reason = isolated_fit(state.inventory, demand)
        if placement is None:
            raise NoFitError(reason)
        return placement

    def gpu_usage(self, node: str) -> list[GpuUsage]:
        """Per-GPU usage from placed charges (pending containers are not on any GPU); [] for a
        node that is unknown or has no inventory."""
        state = self._nodes.get(node)
        if state is None:
            return []
        return [
            GpuUsage(g.index, g.used_cores, g.cores, g.used_memory, g.memory, g.containers, g.healthy)
            for g in sorted(state.gpus.values(), key=lambda g: g.index)
        ]

    def pending_of(self, node: str) -> tuple[int, int, int]:
        """(containers, vcuda-core, MiB) charged to ``node`` whose GPU is not known yet."""
        state = self._nodes.get(node)
        if state is None:
            return (0, 0, 0)
        return (state.pending_containers, state.pending_cores, state.pending_memory)
