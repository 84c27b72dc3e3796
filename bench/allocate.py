"""GetPreferredAllocation + Allocate round trips over the real unix socket.

Starts `vcuda-agent run --no-kube --simulate 8xH100-80GB` as a real process and
drives it with the kubelet emulator's gRPC stubs, as kubelet would: for each
request size, GetPreferredAllocation over the free IDs, then Allocate of the
answer. Sizes cycle over shares and whole GPUs. Target: p99 <= 5 ms.

Then the same node in Kubernetes mode (the fake API server, the kubelet emulator
with pod-resources): 1000 pods in the node's cache, most of them Pending and
waiting for a GPU share, half of those placed by the extender. Each round trip is
kubelet's GetPreferredAllocation + Allocate for one of them, which the agent must
match to its pod among the 1000. Target: p99 <= 10 ms.

Interleaved with those, the same number of bare round trips (two
GetDevicePluginOptions calls) measure the floor of Python gRPC over the socket on
this machine, and the same requests handed straight to the servicer (no socket)
measure the plugin's own work, so all three can be read off one run.

    .venv/bin/python bench/allocate.py [--rounds N] [--spec 8xH100-80GB] [--pods 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.queues
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import cast

import grpc

from agent.domain.health import HealthBoard
from agent.domain.ids import ids_for_gpu
from agent.emulators.apiserver import FakeApiServer
from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import running_sim_node, sim_agent_command
from agent.platform.driverfiles import DriverFiles
from agent.platform.gpu.sim.inventory import sim_gpus, sim_topology
from agent.platform.gpu.sim.spec import parse_simulate_spec
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.service import DevicePluginService

SIZES = (30, 50, 100, 200, 10, 400)
PACE_S = 0.05


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def handler_latencies(requests: list[pb.PreferredAllocationRequest], rounds: int, spec: str) -> list[float]:
    """The same round trips handed to the servicer in this process: the plugin's own work."""
    models = parse_simulate_spec(spec)
    gpus = sim_gpus("bench", models)
    service = DevicePluginService(
        gpus,
        sim_topology(models),
        HealthBoard(g.index for g in gpus),
        ResponseBuilder(DeviceListStrategy.MOUNTS, DriverFiles()),
    )
    context = cast(grpc.ServicerContext, None)  # only touched on errors, which these requests avoid
    # The IDs of this node differ from the agent's (other node name): rebuild the requests.
    available = [d for g in gpus for d in ids_for_gpu(g.uuid)]
    local = [
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    allocation_size=r.container_requests[0].allocation_size,
                )
            ]
        )
        for r in requests
    ]
    latencies: list[float] = []
    for i in range(rounds + 200):
        started = time.perf_counter()
        preferred = service.GetPreferredAllocation(local[i % len(local)], context)
        ids = preferred.container_responses[0].deviceIDs
        service.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            context,
        )
        if i >= 200:
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--spec", default="8xH100-80GB")
    parser.add_argument("--pods", type=int, default=1000, help="pods in the node's cache (Kubernetes mode)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-bench-", dir="/tmp"))
    try:
        with running_sim_node(args.spec, workdir) as (_agent, kubelet):
            plain = run_rounds(kubelet, args.rounds, args.spec)
        with running_kube_node(args.spec, workdir / "kube", args.pods) as (kubelet, pending):
            back_to_back, with_pods = kube_rounds(kubelet, pending)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, values in (("50 ms apart", with_pods), ("back to back", back_to_back)):
        print(
            f"Kubernetes mode, {args.pods} pods in the cache, {name}: {len(values)} round trips, "
            f"p50 {percentile(values, 50):.2f} ms, p99 {percentile(values, 99):.2f} ms, "
            f"max {max(values):.2f} ms"
        )
    print(
        f"RESULT {plain} allocate_with_pods_p50_ms={percentile(with_pods, 50):.2f} "
        f"allocate_with_pods_p99_ms={percentile(with_pods, 99):.2f} "
        f"allocate_with_pods_back_to_back_p99_ms={percentile(back_to_back, 99):.2f}"
    )
    return 0


def run_rounds(kubelet: KubeletEmulator, rounds: int, spec: str) -> str:
    plugin = kubelet.wait_for_plugin(timeout_s=30)
    available = sorted(plugin.devices)
    # Requests are built once: kubelet builds its own in Go; only the plugin's round trip is timed.
    requests = [
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)
            ]
        )
        for size in SIZES
    ]
    latencies: list[float] = []
    floor: list[float] = []
    for i in range(rounds + 200):
        request = requests[i % len(requests)]
        started = time.perf_counter()
        preferred = plugin.stub.GetPreferredAllocation(request, timeout=10)
        ids = preferred.container_responses[0].deviceIDs
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=10,
        )
        middle = time.perf_counter()
        plugin.stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        plugin.stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        if i >= 200:  # the first rounds warm up connections and caches
            latencies.append((middle - started) * 1000)
            floor.append((time.perf_counter() - middle) * 1000)
    handler = handler_latencies(requests, rounds, spec)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(
        f"{len(latencies)} round trips on {spec} ({len(available)} device IDs offered each time), "
        f"sizes {SIZES}: mean {statistics.fmean(latencies):.2f} ms, max {max(latencies):.2f} ms"
    )
    for name, values in (
        ("gRPC floor (two empty calls)", floor),
        ("servicer alone (no socket)", handler),
    ):
        print(f"{name}: p50 {percentile(values, 50):.2f} ms, p99 {percentile(values, 99):.2f} ms")
    return (
        f"allocate_p50_ms={p50:.2f} allocate_p99_ms={p99:.2f} "
        f"grpc_floor_p50_ms={percentile(floor, 50):.2f} grpc_floor_p99_ms={percentile(floor, 99):.2f} "
        f"handler_p50_ms={percentile(handler, 50):.2f} handler_p99_ms={percentile(handler, 99):.2f}"
    )


@contextlib.contextmanager
def running_kube_node(spec: str, workdir: Path, pods: int) -> Iterator[tuple[KubeletEmulator, list[str]]]:
    """A node in Kubernetes mode with ``pods`` pods on it; yields the kubelet emulator and the
    uids of the Pending GPU pods. The API server runs in its own process, as it would: its
    threads must not compete with this one for the GIL while round trips are timed."""
    workdir.mkdir(parents=True)
    context = multiprocessing.get_context("spawn")
    uids: multiprocessing.queues.Queue[list[str]] = context.Queue()
    done = context.Event()
    server = context.Process(target=_serve_api, args=(workdir, pods, uids, done), daemon=True)
    server.start()
    pending = uids.get(timeout=120)
    kubelet = KubeletEmulator(workdir / "dp", pod_resources_socket=workdir / "pr.sock")
    kubelet.start()
    kube = (workdir / "kubeconfig", workdir / "pr.sock")
    port = free_port()
    cmd = sim_agent_command(
        spec,
        workdir / "dp",
        workdir / "sim",
        metrics_address=f"127.0.0.1:{port}",
        kube=kube,
        extra=("--log-level", "WARNING"),
    )
    agent = subprocess.Popen(cmd)
    try:
        wait_until_started(port)
        yield kubelet, pending
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        kubelet.stop()
        done.set()
        server.join(timeout=10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_started(port: int, timeout_s: float = 120.0) -> None:
    """Until the agent's start-up work is over: the ioctl tracer compiles its BPF program in the
    background (seconds of CPU on this 2-core machine), which must not overlap timed rounds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                text = answer.read().decode()
            if re.search(r'^vcuda_bpf_status\{[^}]*status="starting"\} 0\.0$', text, re.M):
                return
        time.sleep(0.2)
    raise TimeoutError(f"the agent did not finish starting within {timeout_s:.0f} s")


def _serve_api(workdir: Path, pods: int, uids: multiprocessing.queues.Queue[list[str]], done: Event) -> None:
    api = FakeApiServer()
    api.start()
    api.create_node("sim-node")
    pending: list[str] = []
    for i in range(pods):
        if i % 5 >= 3:  # two fifths are ordinary pods without GPUs
            web = {"name": "web", "image": "nginx"}
            api.create_pod(
                {"metadata": {"name": f"web-{i}"}, "spec": {"nodeName": "sim-node", "containers": [web]}}
            )
            continue
        # Placed by the extender, spread over the GPUs (a binpacking plugin alone would not).
        notes = {"nvidia.com/predicate-gpu-idx-0": str(len(pending) % 8), "nvidia.com/predicate-time": str(i)}
        pending.append(api.create_pod(_share_pod(f"job-{i}", notes))["metadata"]["uid"])
    api.write_kubeconfig(workdir / "kubeconfig")
    uids.put(pending)
    done.wait()
    api.stop()


def _share_pod(name: str, annotations: dict[str, str]) -> dict[str, object]:
    limits = {"nvidia.com/vcuda-core": "1", "nvidia.com/vcuda-memory": "64"}
    return {
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "nodeName": "sim-node",
            "containers": [{"name": "cuda", "image": "cuda", "resources": {"limits": limits}}],
        },
    }


def kube_rounds(kubelet: KubeletEmulator, pending: list[str]) -> tuple[list[float], list[float]]:
    """kubelet's GetPreferredAllocation + Allocate for each pending pod, timed; alternately
    back to back and after a 50 ms pause (kubelet admits pods one at a time, and each
    admission also starts containers: the agent's work after an Allocate (the annotation
    PATCH, the watch event it causes) is done by the next admission in practice)."""
    plugin = kubelet.wait_for_plugin(timeout_s=60)  # registered once its pod cache has synced
    back_to_back: list[float] = []
    paced: list[float] = []
    for i, uid in enumerate(pending):
        if i % 2:
            time.sleep(PACE_S)
        available = [d for d in plugin.healthy_ids() if d not in kubelet.in_use(plugin.resource)]
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=1)
            ]
        )
        started = time.perf_counter()
        ids = list(plugin.stub.GetPreferredAllocation(request, timeout=10).container_responses[0].deviceIDs)
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10
        )
        if i >= 20:  # the first rounds warm up connections
            (paced if i % 2 else back_to_back).append((time.perf_counter() - started) * 1000)
        kubelet.allocated[(uid, "cuda", plugin.resource)] = ids
    return back_to_back, paced


if __name__ == "__main__":
    raise SystemExit(main())
