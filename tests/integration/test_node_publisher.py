"""NodePublisher against the fake API server over HTTP, through the real kubernetes client:
vcuda-memory capacity, its re-assertion after kubelet zeroes it, health and scaling
changes, the inventory annotation and its heartbeat, GFD labels, API errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
from kubernetes.client import ApiClient

from agent.clock import Clock, VirtualClock
from agent.control.nodepublisher import NodePublisher
from agent.domain.health import HealthBoard
from agent.domain.nodeinventory import (
    CAPACITY_RESOURCE,
    COUNT_LABEL,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
    NodeInventory,
    decode,
)
from agent.emulators.apiserver import FakeApiServer
from agent.platform.gpu.inventory import GpuInfo, Link, Topology, TopologyLevel
from agent.platform.gpu.sim.inventory import sim_numa_nodes, sim_topology
from agent.platform.gpu.sim.spec import parse_simulate_spec
from agent.platform.kube.nodes import NodeClient, NodeWatch
from tests.integration.kubeapi import NODE, apiserver, kube, running, wait_until

__all__ = ["apiserver", "kube"]  # fixtures

SPEC = "4xH100-80GB"
PER_GPU_MIB = 73728  # floor(81920 x 0.9)


def sim_gpus(spec: str) -> list[GpuInfo]:
    models = parse_simulate_spec(spec)
    numa = sim_numa_nodes(len(models))
    return [
        GpuInfo(
            i, f"GPU-{i:08d}-1111-2222-3333-444444444444", m.product_name, m.memory_mib, i, f"0:{i}", numa[i]
        )
        for i, m in enumerate(models)
    ]


@dataclass
class Harness:
    api: FakeApiServer
    publisher: NodePublisher
    board: HealthBoard
    gpus: list[GpuInfo]
    scaling: list[float]

    def capacity(self) -> tuple[str | None, str | None]:
        status = (self.api.node(NODE) or {}).get("status") or {}
        return (
            (status.get("capacity") or {}).get(CAPACITY_RESOURCE),
            (status.get("allocatable") or {}).get(CAPACITY_RESOURCE),
        )

    def published(self, mib: int) -> bool:
        return self.capacity() == (str(mib), str(mib))

    def inventory(self) -> NodeInventory | None:
        text = (
            ((self.api.node(NODE) or {}).get("metadata") or {})
            .get("annotations", {})
            .get(INVENTORY_ANNOTATION)
        )
        return decode(text) if text else None


def wait_inventory(
    h: Harness,
    accept: Callable[[NodeInventory], bool] = lambda _: True,
    timeout_s: float = 10.0,
    what: str = "inventory annotation",
) -> NodeInventory:
    def check() -> NodeInventory | None:
        inventory = h.inventory()
        return inventory if inventory is not None and accept(inventory) else None

    found = wait_until(check, timeout_s, what)
    assert found is not None
    return found


@contextmanager
def publishing(
    kube: ApiClient,
    api: FakeApiServer,
    *,
    watch: bool = True,
    check_interval_s: float = 60.0,
    heartbeat_s: float = 30.0,
    clock: Clock | None = None,
    spec: str = SPEC,
) -> Iterator[Harness]:
    """The publisher (and, with ``watch``, the node watch) running in threads; ``spec`` ""
    is a node without GPUs."""
    gpus = sim_gpus(spec) if spec else []
    board = HealthBoard(g.index for g in gpus)
    node_watch = NodeWatch(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)
    scaling = [0.9]  # the live node config's deviceMemoryScaling; tests change it
    publisher = NodePublisher(
        NodeClient(kube, NODE),
        node_watch,
        gpus,
        sim_topology(parse_simulate_spec(spec)) if spec else Topology(),
        board,
        scaling=lambda: scaling[0],
        node_name=NODE,
        clock=clock,
        check_interval_s=check_interval_s,
        heartbeat_s=heartbeat_s,
        poll_s=0.05,
    )
    with ExitStack() as stack:
        if watch:
            stack.enter_context(running(node_watch.run, "node-watch"))
        stack.enter_context(running(publisher.run, "node-publisher"))
        yield Harness(api, publisher, board, gpus, scaling)


def test_publishes_capacity_inventory_and_labels(kube: ApiClient, apiserver: FakeApiServer) -> None:
    apiserver.create_node(NODE, labels={"team": "ml"})
    with publishing(kube, apiserver, check_interval_s=0.1) as h:
        wait_until(lambda: h.published(4 * PER_GPU_MIB), what="vcuda-memory published")
        inventory = wait_inventory(h)
        assert inventory.node == NODE
        assert inventory.memory_scaling == 0.9
        assert abs(inventory.heartbeat - time.time()) < 5
        assert [(g.index, g.uuid, g.model) for g in inventory.gpus] == [
            (g.index, g.uuid, g.model) for g in h.gpus
        ]
        assert [g.schedulable_mib for g in inventory.gpus] == [PER_GPU_MIB] * 4
        assert [g.numa for g in inventory.gpus] == [0, 0, 1, 1]
        assert all(g.healthy and g.cores == 100 for g in inventory.gpus)
        assert inventory.gpus[0].links == {
            1: Link(TopologyLevel.SINGLE_SWITCH, 18),
            2: Link(TopologyLevel.SYSTEM),
            3: Link(TopologyLevel.SYSTEM),
        }
        node = apiserver.node(NODE) or {}
        assert node["metadata"]["labels"] == {
            "kubernetes.io/hostname": NODE,
            "team": "ml",
            PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3",
            COUNT_LABEL: "4",
            MEMORY_LABEL: "81920",
        }
        assert node["status"]["capacity"]["cpu"] == "16"  # kubelet's resources untouched

        # Steady state: passes keep running (every 0.1 s here) and write nothing more.
        passes = h.publisher.stats.passes
        wait_until(lambda: h.publisher.stats.passes >= passes + 10, what="ten more passes")
        stats = h.publisher.stats
        assert (stats.capacity_patches, stats.metadata_patches, stats.errors) == (1, 1, 0)
        assert stats.capacity_mib == 4 * PER_GPU_MIB
        patches = [r for r in apiserver.request_log if r.method == "PATCH"]
        assert [r.path for r in patches] == [f"/api/v1/nodes/{NODE}/status", f"/api/v1/nodes/{NODE}"]


@pytest.mark.parametrize(
    ("watch", "check_interval_s"),
    [(True, 60.0), (False, 0.5)],
    ids=["by-watch", "by-periodic-check"],
)
def test_reasserted_when_kubelet_zeroes_it(
    kube: ApiClient,
    apiserver: FakeApiServer,
    watch: bool,
    check_interval_s: float,
    record_property: Callable[[str, object], None],
) -> None:
    apiserver.create_node(NODE)
    with publishing(kube, apiserver, watch=watch, check_interval_s=check_interval_s) as h:
        wait_until(lambda: h.published(4 * PER_GPU_MIB), what="vcuda-memory published")
        for _ in range(3):
            zeroed = time.monotonic()
            apiserver.zero_extended_resources(NODE)
            wait_until(lambda: h.published(4 * PER_GPU_MIB), timeout_s=10.0, what="re-asserted")
            took = time.monotonic() - zeroed
            record_property("reassert_s", round(took, 3))
            # Issue requirement: within 10 s. The watch makes it immediate even with a 60 s
            # check interval; without it, the periodic check bounds it.
            assert took < 5.0
        wait_until(lambda: h.publisher.stats.capacity_patches == 4, what="four capacity patches")


def test_health_and_scaling_changes_move_capacity(kube: ApiClient, apiserver: FakeApiServer) -> None:
    apiserver.create_node(NODE)
    with publishing(kube, apiserver) as h:
        wait_until(lambda: h.published(4 * PER_GPU_MIB), what="vcuda-memory published")

        h.board.set(2, False, "XID 79 (GPU has fallen off the bus)")
        wait_until(lambda: h.published(3 * PER_GPU_MIB), timeout_s=10.0, what="capacity drops")
        inventory = wait_inventory(h, lambda i: not i.gpus[2].healthy)
        assert [g.healthy for g in inventory.gpus] == [True, True, False, True]
        assert inventory.capacity_mib == 3 * PER_GPU_MIB

        h.board.set(2, True, "GPU recovered")
        wait_until(lambda: h.published(4 * PER_GPU_MIB), timeout_s=10.0, what="capacity restored")

        h.scaling[0] = 0.5  # the node config changed
        wait_until(lambda: h.published(4 * 40960), timeout_s=10.0, what="scaled capacity")
        inventory = wait_inventory(h, lambda i: i.memory_scaling == 0.5)
        assert [g.schedulable_mib for g in inventory.gpus] == [40960] * 4


def test_heartbeat_advances(kube: ApiClient, apiserver: FakeApiServer) -> None:
    apiserver.create_node(NODE)
    with publishing(kube, apiserver, heartbeat_s=1.0) as h:
        first = wait_inventory(h)
        later = wait_inventory(h, lambda i: i.heartbeat >= first.heartbeat + 1, 5.0, "a newer heartbeat")
        assert later.gpus == first.gpus
        assert h.publisher.stats.capacity_patches == 1  # heartbeats write only the annotation


def test_heartbeat_in_virtual_time(kube: ApiClient, apiserver: FakeApiServer) -> None:
    apiserver.create_node(NODE)
    clock = VirtualClock(start=1000.0)
    with publishing(kube, apiserver, heartbeat_s=30.0, check_interval_s=10.0, clock=clock) as h:
        first = wait_inventory(h)
        assert first.heartbeat == 1000.0  # the clock's wall time
        wait_until(lambda: h.publisher.stats.metadata_patches == 1, what="the first pass done")
        clock.advance(29.0)
        passes = h.publisher.stats.passes
        clock.advance(2.0)  # past the 10 s check and the 30 s heartbeat
        later = wait_inventory(h, lambda i: i.heartbeat == 1031.0, what="the heartbeat at 1031")
        assert later.gpus == first.gpus
        assert h.publisher.stats.passes > passes
        wait_until(lambda: h.publisher.stats.metadata_patches == 2, what="one heartbeat write")


def test_api_errors_are_logged_once_and_retried(
    kube: ApiClient, apiserver: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.control.nodepublisher")
    with publishing(kube, apiserver, check_interval_s=0.2) as h:
        # No node yet (404 on every pass): the loop keeps trying and logs the error once.
        wait_until(lambda: h.publisher.stats.errors >= 3, what="repeated errors")
        assert "404" in h.publisher.stats.last_error and NODE in h.publisher.stats.last_error
        apiserver.create_node(NODE)
        wait_until(lambda: h.published(4 * PER_GPU_MIB), what="published once the node exists")
        wait_until(lambda: any("works again" in r.getMessage() for r in caplog.records), what="recovery log")
        failures = [r for r in caplog.records if "cannot publish" in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in failures]

        # The API server fails a burst of requests while kubelet zeroes the capacity.
        errors = h.publisher.stats.errors
        apiserver.fail_next(4, 500)
        apiserver.zero_extended_resources(NODE)
        wait_until(lambda: h.published(4 * PER_GPU_MIB), timeout_s=10.0, what="recovered")
        stats = h.publisher.stats
        assert stats.errors > errors
        assert stats.last_success is not None and stats.last_success > time.time() - 10


def test_a_node_without_gpus_drops_stale_labels(kube: ApiClient, apiserver: FakeApiServer) -> None:
    # e.g. the GPUs were removed, or the driver no longer sees them.
    stale = {PRODUCT_LABEL: "NVIDIA-A100-SXM4-40GB", COUNT_LABEL: "8", MEMORY_LABEL: "40960"}
    apiserver.create_node(NODE, labels=stale, capacity={"cpu": "16", CAPACITY_RESOURCE: "327680"})
    with publishing(kube, apiserver, spec="") as h:
        wait_until(lambda: h.published(0), what="vcuda-memory 0")
        inventory = wait_inventory(h)
        assert inventory.gpus == ()

        def labels() -> dict[str, str]:
            return dict((apiserver.node(NODE) or {})["metadata"]["labels"])

        wait_until(lambda: not set(labels()) & set(stale), what="stale GFD labels removed")
        assert labels() == {"kubernetes.io/hostname": NODE}
