"""Publishes this node's GPU offer on its Node object and keeps it there.

- ``nvidia.com/vcuda-memory`` in status.capacity and status.allocatable, in MiB: the sum
  over healthy GPUs of floor(memory x deviceMemoryScaling). kubelet zeroes extended
  resources when it finds the node re-created; the publisher sees that on the node watch
  and re-asserts at once, and re-checks every ``check_interval_s`` anyway.
- The inventory annotation (``domain/nodeinventory.py``) for the scheduler extender,
  written when its content changes and at least every ``heartbeat_s`` (the heartbeat).
- GPU feature discovery's labels (product, count, memory; with a MIG source, the MIG labels
  too: ``domain/miginventory.py``), and the MIG side of each GPU in the annotation.

What triggers a pass: a node watch event (at once), a GPU health change, a MIG change or a new
memory scaling (within ``poll_s``), the periodic check, the heartbeat. API errors never leave
``run()``: they are logged once per distinct message, counted, and retried with back-off
capped at ``check_interval_s`` so a recovered API server gets the node right again within
one check interval.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.clock import Clock, SystemClock
from agent.control.retrylog import RetryLog
from agent.domain.health import HealthBoard
from agent.domain.miginventory import MigEntry, mig_entry, mig_labels, stale_count_labels
from agent.domain.nodeinventory import (
    CAPACITY_RESOURCE,
    INVENTORY_ANNOTATION,
    InventoryFormatError,
    NodeInventory,
    build_inventory,
    decode,
    encode,
    gpu_labels,
)
from agent.errors import KubeError
from agent.platform.gpu.inventory import GpuInfo, Topology
from agent.platform.gpu.migstate import MigInfo
from agent.platform.kube.nodes import NodeClient, NodeWatch

log = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.5
MigSource = Callable[[], tuple[int, Mapping[int, MigInfo]]]  # (version, MIG state per GPU index)


@dataclass(frozen=True)
class _Plan:
    capacity: bool  # vcuda-memory in capacity or allocatable differs
    labels: dict[str, str | None]  # labels to set (None: remove)
    annotation: bool  # the inventory annotation is stale, different or missing

    @property
    def needed(self) -> bool:
        return self.capacity or self.annotation or bool(self.labels)


@dataclass
class PublisherStats:
    """Counters for metrics; times are ``clock.wall()`` seconds."""

    passes: int = 0  # reconcile passes, successful or not
    capacity_patches: int = 0  # status patches of vcuda-memory (each one a re-assertion)
    metadata_patches: int = 0  # label / annotation patches (heartbeats included)
    errors: int = 0
    last_success: float | None = None
    last_error: str = ""
    capacity_mib: int | None = None  # the value last published


class NodePublisher:
    """Keeps capacity, the inventory annotation and the GFD labels on the node (module docstring)."""

    def __init__(
        self,
        nodes: NodeClient,
        watch: NodeWatch,
        gpus: Sequence[GpuInfo],
        topology: Topology,
        board: HealthBoard,
        *,
        scaling: Callable[[], float],
        node_name: str,
        clock: Clock | None = None,
        check_interval_s: float = 10.0,
        heartbeat_s: float = 30.0,
        poll_s: float = 0.5,
        mig: MigSource | None = None,
        withheld: Callable[[], Collection[int]] = frozenset,
        mig_strategy: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``mig``: the GPUs' MIG state (``MigWatch.snapshot``); None publishes no MIG.
        ``withheld``: the GPUs that offer no shares (in MIG mode; a change touches the health
        board); ``mig_strategy``: the node config's, for the label (None: from the MIG state)."""
        self._nodes = nodes
        self._watch = watch
        self._gpus = tuple(sorted(gpus, key=lambda g: g.index))
        self._topology = topology
        self._board = board
        self._scaling = scaling
        self._node_name = node_name
        self._clock = clock or SystemClock()
        self._check_s = check_interval_s
        self._heartbeat_s = heartbeat_s
        self._poll_s = poll_s
        self._labels = gpu_labels(self._gpus)
        self._mig = mig
        self._withheld = withheld
        self._mig_strategy = mig_strategy
        self._seen_mig = 0
        self._lock = threading.Lock()
        self._stats = PublisherStats()
        self._heartbeat_at: float | None = None  # clock.monotonic() of our last annotation write
        self._retry_log = RetryLog(
            log,
            f"node {node_name}: cannot publish the GPU offer",
            f"node {node_name}: publishing works again",
        )
        self._seen_node = self._seen_board = 0  # versions the last pass was based on
        self._seen_scaling = 0.0

    @property
    def stats(self) -> PublisherStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def run(self, stop: threading.Event) -> None:
        backoff = _MIN_BACKOFF_S
        while not stop.is_set():
            if self.sync():
                backoff = _MIN_BACKOFF_S
                self._wait(stop)
                continue
            if self._clock.sleep(backoff, stop):
                return
            backoff = min(backoff * 2, max(self._check_s, _MIN_BACKOFF_S))

    def sync(self) -> bool:
        """One pass: patch what differs on the node; False when the API failed (logged, counted).

        The watch's copy of the node may lag our own last patch, so a difference it shows
        is confirmed with a fresh GET before anything is written."""
        with self._lock:
            self._stats.passes += 1
        # What this pass is based on, taken first, so that a change during the pass wakes the next.
        self._seen_node = self._watch.version
        self._seen_board, health = self._board.snapshot()
        self._seen_scaling = self._scaling()
        healthy = {index: state.healthy for index, state in health.items()}
        labels, mig = self._mig_view(healthy)
        desired = build_inventory(
            self._node_name,
            self._gpus,
            self._topology,
            healthy=healthy,
            scaling=self._seen_scaling,
            heartbeat=0.0,
            mig=mig,
            withheld=self._withheld(),
        )
        try:
            node = self._watch.current()
            plan = self._plan(node, desired, labels) if node is not None else None
            if plan is None or plan.needed:
                plan = self._plan(self._nodes.get(), desired, labels)
            self._apply(plan, desired)
        except KubeError as err:
            self._failed(err)
            return False
        self._succeeded()
        return True

    def _mig_view(
        self, healthy: Mapping[int, bool]
    ) -> tuple[dict[str, str | None], dict[int, MigEntry | None]]:
        """The labels to publish and each GPU's MIG side for the annotation (the MIG state
        version seen is recorded, so that a change wakes the next pass)."""
        if self._mig is None:
            return dict(self._labels), {}
        self._seen_mig, infos = self._mig()
        bad: dict[int, set[int]] = {}
        for index, gi in self._board.unhealthy_instances():
            bad.setdefault(index, set()).add(gi)
        mig = {
            index: mig_entry(info, bad.get(index, ()), healthy.get(index, True))
            for index, info in infos.items()
        }
        return {**self._labels, **mig_labels(infos, self._mig_strategy())}, mig

    def _plan(
        self, node: Mapping[str, Any], desired: NodeInventory, labels: Mapping[str, str | None]
    ) -> _Plan:
        status = node.get("status") or {}
        meta = node.get("metadata") or {}
        capacity = str(desired.capacity_mib)
        current = meta.get("labels") or {}
        return _Plan(
            capacity=any(
                (status.get(f) or {}).get(CAPACITY_RESOURCE) != capacity for f in ("capacity", "allocatable")
            ),
            labels=_changed(current, {**labels, **stale_count_labels(current, labels)}),
            annotation=self._annotation_due(meta.get("annotations") or {}, desired),
        )

    def _apply(self, plan: _Plan, desired: NodeInventory) -> None:
        if plan.capacity:
            self._nodes.patch_extended_resources({CAPACITY_RESOURCE: str(desired.capacity_mib)})
            with self._lock:
                self._stats.capacity_patches += 1
                self._stats.capacity_mib = desired.capacity_mib
            log.info(
                "node %s: %s = %d MiB published", self._node_name, CAPACITY_RESOURCE, desired.capacity_mib
            )
        if plan.labels or plan.annotation:
            annotations: dict[str, str | None] = {}
            stamped_at = self._clock.monotonic()
            if plan.annotation:
                stamped = dataclasses.replace(desired, heartbeat=self._clock.wall())
                annotations[INVENTORY_ANNOTATION] = encode(stamped)
            self._nodes.patch_metadata(plan.labels, annotations)
            if plan.annotation:
                self._heartbeat_at = stamped_at
            with self._lock:
                self._stats.metadata_patches += 1

    def _annotation_due(self, annotations: Mapping[str, Any], desired: NodeInventory) -> bool:
        if self._heartbeat_at is None or self._clock.monotonic() - self._heartbeat_at >= self._heartbeat_s:
            return True
        text = annotations.get(INVENTORY_ANNOTATION)
        if not isinstance(text, str):
            return True
        try:
            current = decode(text)
        except InventoryFormatError:
            return True
        return dataclasses.replace(current, heartbeat=0.0) != desired

    def _wait(self, stop: threading.Event) -> None:
        """Until the node changes (at once), health or scaling change (within ``poll_s``),
        the next periodic check or heartbeat is due, or ``stop``."""
        deadline = self._clock.monotonic() + self._check_s
        if self._heartbeat_at is not None:
            deadline = min(deadline, self._heartbeat_at + self._heartbeat_s)
        while not stop.is_set():
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return
            if (
                self._watch.wait_for_change(self._seen_node, min(remaining, self._poll_s), stop)
                != self._seen_node
            ):
                return
            if self._board.snapshot()[0] != self._seen_board or self._scaling() != self._seen_scaling:
                return
            if self._mig is not None and self._mig()[0] != self._seen_mig:
                return

    def _failed(self, err: KubeError) -> None:
        message = str(err)
        with self._lock:
            self._stats.errors += 1
            self._stats.last_error = message
        self._retry_log.failed(message)

    def _succeeded(self) -> None:
        with self._lock:
            self._stats.last_success = self._clock.wall()
        self._retry_log.succeeded()


def _changed(current: Mapping[str, Any], desired: Mapping[str, str | None]) -> dict[str, str | None]:
    """The labels to patch: values that differ, and ``None`` for keys to remove that exist."""
    return {
        key: value
        for key, value in desired.items()
        if (value is None and key in current) or (value is not None and current.get(key) != value)
    }
