"""Scheduler extender: filter + prioritize for one pod against 1000 nodes x 8 GPUs with 5000
placed pods. Target: p99 <= 20 ms.

The extender's view is fed the nodes (inventory annotations) and the placed pods (predicate
annotations) through its watch handlers, as the informers would; then each round is what
kube-scheduler does for one pod in nodeCacheCapable mode: POST /filter with every node name,
then POST /prioritize with the nodes that passed, over one keep-alive HTTP connection to the
real server on loopback, which runs in a process of its own (as it does in production: the
client does not share its GIL). Side by side, interleaved: the same rounds over HTTPS with a
client certificate (how deploy/ runs it; certificates from deploy/extender-tls/make-certs.sh),
and the same bodies handed straight to a service in this process (JSON decoding and the
domain work, no HTTP), which show what HTTP and TLS add.

    .venv/bin/python bench/extender.py [--rounds 300] [--nodes 1000] [--gpus 8] [--pods 5000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from agent.control.extenderbind import Binder
from agent.control.extenderview import ExtenderView
from agent.domain.annotations import PREDICATE_NODE, predicate_key
from agent.domain.clusterbook import ClusterBook
from agent.domain.nodeinventory import INVENTORY_ANNOTATION, GpuEntry, NodeInventory, encode
from agent.platform.gpu.inventory import Link, TopologyLevel
from agent.platform.kube.pods import PodInfo
from agent.settings import ExtenderSettings
from agent.surfaces.extender.server import ExtenderServer
from agent.surfaces.extender.service import ExtenderService
from agent.surfaces.extender.transport import server_context

ROOT = Path(__file__).resolve().parents[1]
POD = ROOT / "tests/integration/extender_payloads/pod_share50.json"
MAKE_CERTS = ROOT / "deploy/extender-tls/make-certs.sh"


class _NoApi:
    """Bind is not measured here."""

    def get(self, namespace: str, name: str) -> PodInfo:
        raise NotImplementedError

    def patch_annotations(self, *args: Any, **kwargs: Any) -> PodInfo:
        raise NotImplementedError

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        raise NotImplementedError


def node_object(name: str, gpus: int, now: float) -> dict[str, Any]:
    entries = tuple(
        GpuEntry(
            index=i,
            uuid=f"GPU-{name}-{i}",
            model="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            schedulable_mib=73403,
            numa=i // 4,
            healthy=True,
            # NVLink within each half of the board, PCIe across (a common 8-GPU layout).
            links={
                j: Link(TopologyLevel.SINGLE_SWITCH, 12) if i // 4 == j // 4 else Link(TopologyLevel.SYSTEM)
                for j in range(gpus)
                if j != i
            },
        )
        for i in range(gpus)
    )
    text = encode(NodeInventory(name, now, 0.9, entries))
    return {"metadata": {"name": name, "resourceVersion": "1", "annotations": {INVENTORY_ANNOTATION: text}}}


def placed_pod(i: int, node: str, gpu: int, cores: int, memory: int) -> dict[str, Any]:
    limits = {"nvidia.com/vcuda-core": str(cores), "nvidia.com/vcuda-memory": str(memory)}
    return {
        "metadata": {
            "name": f"placed-{i}",
            "namespace": "bench",
            "uid": f"uid-placed-{i}",
            "resourceVersion": str(10 + i),
            "annotations": {predicate_key(0, False): str(gpu), PREDICATE_NODE: node},
        },
        "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"},
    }


def build_view(nodes: int, gpus: int, pods: int, seed: int) -> tuple[ExtenderView, list[str]]:
    view = ExtenderView(ClusterBook())
    now = time.time()
    names = [f"gpu-node-{i:04d}" for i in range(nodes)]
    for name in names:
        view.on_node_event("ADDED", node_object(name, gpus, now))
    rng = random.Random(seed)
    for i in range(pods):
        cores = rng.choice((10, 20, 25, 30, 40))
        view.on_pod_event("ADDED", placed_pod(i, rng.choice(names), rng.randrange(gpus), cores, cores * 700))
    view.mark_synced("nodes")
    view.mark_synced("pods")
    return view, names


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def serve(args: argparse.Namespace, certs: Path, ports: Connection, stop: Event) -> None:
    """The extender in a process of its own, as in production: the client's work does not
    compete with it for the GIL. Two servers on one view: plain HTTP and HTTPS."""
    view, _ = build_view(args.nodes, args.gpus, args.pods, args.seed)
    service = ExtenderService(view, Binder(view, _NoApi()))
    tls = server_context(
        ExtenderSettings(
            tls_cert=certs / "server.crt", tls_key=certs / "server.key", client_ca=certs / "ca.crt"
        )
    )
    with (
        ExtenderServer("127.0.0.1", 0, service) as plain,
        ExtenderServer("127.0.0.1", 0, service, tls=tls) as secure,
    ):
        ports.send((plain.address[1], secure.address[1]))
        stop.wait()


def connect(port: int, tls: ssl.SSLContext | None = None) -> http.client.HTTPConnection:
    """One keep-alive connection without Nagle, as Go's net/http client (kube-scheduler) has:
    http.client writes headers and a large body separately."""
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=tls)
        if tls
        else http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    )
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connections(ports: tuple[int, int], certs: Path) -> tuple[http.client.HTTPConnection, ...]:
    """(plain, HTTPS with kube-scheduler's client certificate) to the two servers."""
    client = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    client.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    return connect(ports[0]), connect(ports[1], client)


def post(via: http.client.HTTPConnection, verb: str, body: bytes) -> Any:
    via.request("POST", f"/{verb}", body, {"Content-Type": "application/json"})
    response = via.getresponse()
    data = response.read()
    assert response.status == 200, data[:200]
    return json.loads(data)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    context = multiprocessing.get_context("fork")
    ports, child_end = context.Pipe()
    stop = context.Event()
    certs = Path(tempfile.mkdtemp(prefix="vcuda-bench-certs-"))
    subprocess.run([str(MAKE_CERTS), str(certs), "127.0.0.1"], check=True, capture_output=True)
    child = context.Process(target=serve, args=(args, certs, child_end, stop), daemon=True)
    child.start()
    started = time.perf_counter()
    view, names = build_view(args.nodes, args.gpus, args.pods, args.seed)
    took = time.perf_counter() - started
    print(f"view: {args.nodes} nodes x {args.gpus} GPUs, {args.pods} placed pods, built in {took:.2f} s")
    service = ExtenderService(view, Binder(view, _NoApi()))
    pod = json.loads(POD.read_text())
    filter_body = json.dumps({"pod": pod, "nodes": None, "nodenames": names}).encode()
    if not ports.poll(120):
        raise SystemExit("the extender process did not start")
    conn, secure = connections(ports.recv(), certs)

    def round_trip(via: http.client.HTTPConnection) -> int:
        passed = post(via, "filter", filter_body)["nodenames"]
        post(via, "prioritize", json.dumps({"pod": pod, "nodenames": passed}).encode())
        return len(passed)

    def in_process() -> int:
        passed = service.filter(filter_body)["nodenames"]
        service.prioritize(json.dumps({"pod": pod, "nodenames": passed}).encode())
        return len(passed)

    try:
        calls: dict[str, Callable[[], int]] = {
            "http": lambda: round_trip(conn),
            "https": lambda: round_trip(secure),
            "inprocess": in_process,
        }
        for _ in range(10):  # warm-up: connections, caches
            for call in calls.values():
                call()
        runs: dict[str, list[float]] = {label: [] for label in calls}
        fitting = 0
        for _ in range(args.rounds):
            for label, call in calls.items():
                t0 = time.perf_counter()
                fitting = call()
                runs[label].append((time.perf_counter() - t0) * 1000.0)
        server_ms = server_side_ms(conn)
    finally:
        conn.close()
        secure.close()
        shutil.rmtree(certs, ignore_errors=True)
        stop.set()
        child.join(timeout=10)

    print(f"{fitting} of {args.nodes} nodes fit the pod (50 vcuda-core, 20480 MiB)")
    report(runs, server_ms)


def server_side_ms(conn: http.client.HTTPConnection) -> float:
    """Mean time the server spent in filter + prioritize handlers, from its own histogram."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    total = 0.0
    for verb in ("filter", "prioritize"):
        values = {}
        for kind in ("sum", "count"):
            match = re.search(rf'^vcuda_extender_request_seconds_{kind}{{verb="{verb}"}} (\S+)$', text, re.M)
            values[kind] = float(match.group(1)) if match else 0.0
        total += values["sum"] / values["count"] * 1000.0 if values["count"] else 0.0
    return total


def report(runs: dict[str, list[float]], server_ms: float) -> None:
    print(f"{'path':<12}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for label, samples in runs.items():
        p50, p99 = statistics.median(samples), percentile(samples, 0.99)
        print(f"{label:<12}{p50:>10.2f}{p99:>10.2f}{max(samples):>10.2f}")
    print(f"server-side handler time, mean of filter + prioritize: {server_ms:.2f} ms")
    print(
        f"RESULT extender_p99_ms={percentile(runs['http'], 0.99):.2f} "
        f"extender_https_p99_ms={percentile(runs['https'], 0.99):.2f} "
        f"inprocess_p99_ms={percentile(runs['inprocess'], 0.99):.2f}"
    )


if __name__ == "__main__":
    main()
