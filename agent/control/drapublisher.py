"""Publishes this node's GPUs as the DRA driver's ResourceSlice and keeps it right.

The slice's content comes from agent/domain/draslice.py: one shareable device per healthy GPU;
with dynamic MIG also the GPUs' placement devices and counter sets, in several slices of one
pool. A pass lists this node's slices of the driver, deletes any that are not ours (a renamed or
leftover slice would split the pool), and creates or replaces ours when their contents differ,
all with one ``spec.pool.generation`` above every generation seen: consumers use only a pool's
highest generation, so a change that kept the number would go unnoticed (and a pool whose
slices at that generation are fewer than ``resourceSliceCount`` is not used until all are
written). Slices that are already right are not written.

What triggers a pass: start; a GPU health change (the board wakes the loop at once, so an
unhealthy GPU leaves the slice within well under a second); a new deviceMemoryScaling (within
``poll_s``); ``publish_now()``; and every ``check_interval_s`` (a slice deleted or edited by
someone else comes back). API errors never leave ``run()``: logged once per distinct message,
counted, retried with back-off capped at ``check_interval_s``. On a clean stop the slice is
deleted, so the scheduler places no new claims on a node whose driver is gone; a crash leaves
it, and the next start takes it over (same name, next generation).

The slice is owned by this node's Node object (``ownerReferences``: v1 Node, name, uid, as
the kubelet plugin helper of k8s.io/dynamic-resource-allocation sets it), so the garbage
collector deletes it with the Node. The uid is read from the API (``node_uid``); while it
cannot be, the slice is published without an owner (logged once) and every pass tries again;
once known, a slice without the reference gets it (same generation: the devices did not
change). Creating the slice reads the uid afresh, so a Node re-created under the same name
(whose old uid the garbage collector would delete the slice for) is owned by the new one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.clock import Clock, SystemClock
from agent.control.retrylog import RetryLog
from agent.domain.draslice import (
    SliceContent,
    build_slice,
    desired_counters,
    desired_devices,
    is_current,
    is_owned,
    pool_contents,
    pool_generation,
    slice_name,
)
from agent.domain.health import HealthBoard
from agent.errors import KubeError
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.migprofiles import MigProduct
from agent.platform.kube.resourceslices import ResourceSliceClient

log = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.5


@dataclass
class SlicePublisherStats:
    """Counters for metrics and status; times are ``clock.wall()`` seconds."""

    passes: int = 0  # publication passes, successful or not
    writes: int = 0  # creates and replacements of our slice
    deletes: int = 0  # stale slices removed, and ours on stop
    errors: int = 0
    generation: int = 0  # spec.pool.generation of the slice as last seen or written
    devices: int = 0  # devices in the slice as last seen or written
    last_success: float | None = None
    last_error: str = ""


class SlicePublisher:
    """Keeps ``<node>-gpu.vcuda.io`` equal to the healthy GPUs (module docstring)."""

    def __init__(
        self,
        slices: ResourceSliceClient,
        gpus: Sequence[GpuInfo],
        board: HealthBoard,
        *,
        scaling: Callable[[], float],
        node_name: str,
        driver_version: str | None = None,
        clock: Clock | None = None,
        check_interval_s: float = 10.0,
        poll_s: float = 0.2,
        delete_on_stop: bool = True,
        node_uid: Callable[[], str] | None = None,
        dynamic: Callable[[], Mapping[int, MigProduct]] | None = None,
    ) -> None:
        """``dynamic``: the GPUs on dynamic MIG that are ready for it (MIG mode on), and their
        MIG product; looked at every ``poll_s``."""
        self._dynamic = dynamic or dict
        self._seen_dynamic: Mapping[int, MigProduct] = {}
        self._slices = slices
        self._gpus = tuple(sorted(gpus, key=lambda g: g.index))
        self._board = board
        self._scaling = scaling
        self._node = node_name
        self._name = slice_name(node_name)
        self._driver_version = driver_version
        self._clock = clock or SystemClock()
        self._check_s = check_interval_s
        self._poll_s = poll_s
        self._delete_on_stop = delete_on_stop
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stats = SlicePublisherStats()
        self._generation = 0  # the highest pool generation seen or written
        self._retry_log = RetryLog(
            log,
            f"node {node_name}: cannot publish ResourceSlice {self._name}",
            f"node {node_name}: publishing ResourceSlice {self._name} works again",
        )
        self._read_node_uid = node_uid
        self._node_uid = ""  # "" until read: the slice then has no owner
        self._owner_log = RetryLog(
            log,
            f"node {node_name}: ResourceSlice {self._name} is published without an ownerReference "
            "to the Node (not garbage-collected with it) until the Node can be read",
            f"node {node_name}: the Node can be read again; ResourceSlice {self._name} is owned by it",
        )
        self._seen_board = -1  # the board version and scaling the last pass was based on
        self._seen_scaling = 0.0

    @property
    def slice_name(self) -> str:
        return self._name

    @property
    def stats(self) -> SlicePublisherStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def publish_now(self) -> None:
        """Ask the run loop for a pass at once (e.g. after a change it cannot see itself)."""
        self._wake.set()
        self._board.wake_all()  # a loop waiting on the board re-checks the wake event

    def run(self, stop: threading.Event) -> None:
        backoff = _MIN_BACKOFF_S
        while not stop.is_set():
            self._wake.clear()
            if self.sync():
                backoff = _MIN_BACKOFF_S
                self._wait(stop, self._check_s)
                continue
            self._wait(stop, backoff)  # a health change still wakes it: the retry is also a pass
            backoff = min(backoff * 2, max(self._check_s, _MIN_BACKOFF_S))
        if self._delete_on_stop:
            self.withdraw()

    def sync(self) -> bool:
        """One pass (module docstring); False when the API failed (logged and counted)."""
        with self._lock:
            self._stats.passes += 1
        # What the pass is based on is taken first, so a change during the pass wakes the next.
        self._seen_board, health = self._board.snapshot()
        self._seen_scaling = self._scaling()
        self._seen_dynamic = dict(self._dynamic())
        devices = desired_devices(
            self._gpus,
            {index: state.healthy for index, state in health.items()},
            self._seen_scaling,
            self._driver_version,
            self._seen_dynamic,
        )
        try:
            self._publish(pool_contents(self._node, devices, desired_counters(devices)))
        except KubeError as err:
            self._failed(err)
            return False
        self._succeeded()
        return True

    def withdraw(self) -> bool:
        """Delete our slices (clean shutdown); False when the API failed (logged)."""
        try:
            names = {str((s.get("metadata") or {}).get("name")) for s in self._slices.list()} | {self._name}
            for name in sorted(names):
                if self._slices.delete(name):
                    with self._lock:
                        self._stats.deletes += 1
                    log.info("node %s: ResourceSlice %s deleted", self._node, name)
        except KubeError as err:
            log.warning("node %s: cannot delete ResourceSlice %s: %s", self._node, self._name, err)
            return False
        return True

    def _publish(self, contents: list[SliceContent]) -> None:
        current = self._slices.list()
        self._generation = max([self._generation, *(pool_generation(s) for s in current)])
        wanted = {c.name for c in contents}
        ours: dict[str, dict[str, Any]] = {}
        for obj in current:
            meta = obj.get("metadata") or {}
            if meta.get("name") in wanted:
                ours[str(meta["name"])] = obj
                continue
            # Another slice of this driver on this node: left by an older agent, a renamed node
            # or a pool that had more slices. It would make the pool inconsistent.
            if self._slices.delete(str(meta.get("name")), meta.get("resourceVersion")):
                log.info("node %s: stale ResourceSlice %s deleted", self._node, meta.get("name"))
                with self._lock:
                    self._stats.deletes += 1
        uid = self._owner_uid(fresh=self._name not in ours)
        count, devices = len(contents), sum(len(c.devices) for c in contents)
        generations = {pool_generation(o) for o in ours.values()}
        same = (
            len(ours) == count
            and len(generations) == 1
            and all(is_current(ours[c.name], self._node, c.devices, content=c, count=count) for c in contents)
        )
        if same:
            if all(is_owned(o, self._node, uid) for o in ours.values()):
                self._record(generations.pop(), devices, wrote=False)
                return
            generation = generations.pop()  # only the owner changes: same pool contents
        else:
            generation = self._generation + 1
        for content in contents:
            existing = ours.get(content.name)
            if existing is None:
                self._slices.create(
                    build_slice(self._node, (), generation, node_uid=uid, content=content, count=count)
                )
                continue
            rv = (existing.get("metadata") or {}).get("resourceVersion")
            self._slices.replace(
                build_slice(self._node, (), generation, rv, node_uid=uid, content=content, count=count)
            )
        self._generation = max(self._generation, generation)
        self._record(generation, devices, wrote=True)
        log.info(
            "node %s: ResourceSlice %s published: %d device(s) in %d slice(s), pool generation %d",
            self._node,
            self._name,
            devices,
            count,
            generation,
        )

    def _owner_uid(self, *, fresh: bool) -> str:
        """The Node's uid ("" while it cannot be read: logged, tried again next pass)."""
        if self._read_node_uid is None or (self._node_uid and not fresh):
            return self._node_uid
        try:
            uid = self._read_node_uid()
        except KubeError as err:
            self._owner_log.failed(str(err))
            return self._node_uid  # a uid read before is still the best guess
        self._owner_log.succeeded()
        self._node_uid = uid
        return uid

    def _record(self, generation: int, devices: int, *, wrote: bool) -> None:
        with self._lock:
            self._stats.generation = generation
            self._stats.devices = devices
            if wrote:
                self._stats.writes += 1

    def _wait(self, stop: threading.Event, timeout_s: float) -> None:
        """Until health changes (at once), scaling changes (within ``poll_s``), ``publish_now``,
        ``stop``, or ``timeout_s``."""
        deadline = self._clock.monotonic() + timeout_s
        while not stop.is_set() and not self._wake.is_set():
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return
            # The board's condition wakes this at once on a health change; the short timeout
            # bounds how late ``stop`` and a new scaling are noticed.
            version = self._board.wait_for_change(self._seen_board, min(remaining, self._poll_s), self._wake)
            if version != self._seen_board or self._scaling() != self._seen_scaling:
                return
            if dict(self._dynamic()) != self._seen_dynamic:
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
