"""Helpers for the scheduler extender tests: fixture payloads, node inventories, a running
extender (real HTTP server, real watches) against the fake API server."""

from __future__ import annotations

import copy
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.control.extenderbind import Binder
from agent.control.extenderview import ClusterWatch, ExtenderView
from agent.domain.clusterbook import ClusterBook
from agent.domain.nodeinventory import INVENTORY_ANNOTATION, GpuEntry, NodeInventory, encode
from agent.domain.schedrequest import PackPolicy
from agent.emulators.apiserver import FakeApiServer
from agent.platform.gpu.inventory import Link, TopologyLevel
from agent.platform.kube.client import api_client
from agent.platform.kube.podbinding import PodBindingClient
from agent.settings import ExtenderSettings
from agent.surfaces.extender.server import ExtenderServer, ServerLimits
from agent.surfaces.extender.service import ExtenderService
from tests.integration.kubeapi import wait_until

PAYLOADS = Path(__file__).parent / "extender_payloads"
GPU_MIB = 73403  # schedulable MiB of one H100 80GB at memoryScaling 0.9


def payload(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((PAYLOADS / name).read_text())
    return data


def inventory_text(
    node: str,
    gpus: int = 2,
    *,
    schedulable_mib: int = GPU_MIB,
    unhealthy: Sequence[int] = (),
    heartbeat: float | None = None,
    nvlink: Sequence[tuple[int, int]] = (),
) -> str:
    """An inventory annotation value; GPUs are PCIe SYSTEM-linked except the ``nvlink`` pairs."""
    pairs = {frozenset(p) for p in nvlink}

    def link(a: int, b: int) -> Link:
        if frozenset((a, b)) in pairs:
            return Link(TopologyLevel.SINGLE_SWITCH, 12)
        return Link(TopologyLevel.SYSTEM)

    entries = tuple(
        GpuEntry(
            index=i,
            uuid=f"GPU-{node}-{i}",
            model="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            schedulable_mib=schedulable_mib,
            numa=0,
            healthy=i not in unhealthy,
            links={j: link(i, j) for j in range(gpus) if j != i},
        )
        for i in range(gpus)
    )
    inventory = NodeInventory(node, time.time() if heartbeat is None else heartbeat, 0.9, entries)
    return encode(inventory)


def fresh_nodelist() -> dict[str, Any]:
    """The NodeList fixture with each inventory's heartbeat set to now."""
    nodes = payload("nodelist.json")
    for item in nodes["items"]:
        annotations = item["metadata"]["annotations"]
        raw = json.loads(annotations[INVENTORY_ANNOTATION])
        raw["heartbeat"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        annotations[INVENTORY_ANNOTATION] = json.dumps(raw, separators=(",", ":"))
    return nodes


def gpu_pod(
    name: str,
    cores: int | None,
    memory_mib: int | None = None,
    *,
    node: str | None = None,
    annotations: Mapping[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """A pod manifest in the shape of the fixture pod, asking for ``cores`` / ``memory_mib``."""
    pod = copy.deepcopy(payload("pod_share50.json"))
    meta = pod["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
        meta.pop(key, None)
    meta.update(name=name, namespace=namespace, annotations=dict(annotations or {}))
    limits: dict[str, str] = {"cpu": "1"}
    if cores is not None:
        limits["nvidia.com/vcuda-core"] = str(cores)
    if memory_mib is not None:
        limits["nvidia.com/vcuda-memory"] = str(memory_mib)
    pod["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": dict(limits)}
    if node is not None:
        pod["spec"]["nodeName"] = node
    pod.pop("status", None)
    return pod


def args_names(pod: Mapping[str, Any], names: Sequence[str]) -> bytes:
    """ExtenderArgs as kube-scheduler sends them with nodeCacheCapable: true."""
    return json.dumps({"pod": pod, "nodes": None, "nodenames": list(names)}).encode()


def args_nodes(pod: Mapping[str, Any], nodes: Mapping[str, Any]) -> bytes:
    """ExtenderArgs as kube-scheduler sends them with nodeCacheCapable: false."""
    return json.dumps({"pod": pod, "nodes": nodes, "nodenames": None}).encode()


def post(url: str, verb: str, body: bytes, *, tls: ssl.SSLContext | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{url}/{verb}", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30, context=tls) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url: str, path: str, *, tls: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=10, context=tls) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def bind_body(pod: Mapping[str, Any], node: str) -> bytes:
    meta = pod["metadata"]
    return json.dumps(
        {"podName": meta["name"], "podNamespace": meta["namespace"], "podUID": meta["uid"], "node": node}
    ).encode()


@dataclass
class Extender:
    server: ExtenderServer
    view: ExtenderView
    watch: ClusterWatch

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def running_extender(
    apiserver: FakeApiServer,
    kubeconfig: Path,
    *,
    node_policy: PackPolicy = PackPolicy.BINPACK,
    gpu_policy: PackPolicy = PackPolicy.BINPACK,
    max_per_gpu: int = 16,
    stale_after_s: float = 90.0,
    pods: PodBindingClient | None = None,
    tls: ssl.SSLContext | None = None,
    limits: ServerLimits | None = None,
    scheduler_names: tuple[str, ...] = ExtenderSettings.scheduler_names,
) -> Iterator[Extender]:
    """The extender as ``vcuda-agent extender`` wires it, on a loopback port, synced."""
    api = api_client(kubeconfig, in_cluster=False)
    view = ExtenderView(
        ClusterBook(max_per_gpu=max_per_gpu, stale_after_s=stale_after_s),
        node_policy=node_policy,
        gpu_policy=gpu_policy,
    )
    watch = ClusterWatch(api, view)
    binder = Binder(view, pods or PodBindingClient(api), scheduler_names=scheduler_names)
    server = ExtenderServer("127.0.0.1", 0, ExtenderService(view, binder), tls=tls, limits=limits)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    server.start()
    try:
        wait_until(lambda: view.ready, what="extender caches synced")
        yield Extender(server, view, watch)
    finally:
        stop.set()
        server.stop()
        thread.join(timeout=5)
        api.close()  # type: ignore[no-untyped-call]
    assert not thread.is_alive(), "the extender's watches did not stop"
