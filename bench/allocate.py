"""GetPreferredAllocation + Allocate round trips over the real unix socket.

Starts `vcuda-agent run --no-kube --simulate 8xH100-80GB` as a real process and
drives it with the kubelet emulator's gRPC stubs, as kubelet would: for each
request size, GetPreferredAllocation over the free IDs, then Allocate of the
answer. Sizes cycle over shares and whole GPUs. Target: p99 <= 5 ms.

Interleaved with those, the same number of bare round trips (two
GetDevicePluginOptions calls) measure the floor of Python gRPC over the socket on
this machine, and the same requests handed straight to the servicer (no socket)
measure the plugin's own work, so all three can be read off one run.

    .venv/bin/python bench/allocate.py [--rounds N] [--spec 8xH100-80GB]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import cast

import grpc

from agent.domain.health import HealthBoard
from agent.domain.ids import ids_for_gpu
from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import running_sim_node
from agent.platform.driverfiles import DriverFiles
from agent.platform.gpu.simulated import SimulatedBackend
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.service import DevicePluginService

SIZES = (30, 50, 100, 200, 10, 400)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def handler_latencies(requests: list[pb.PreferredAllocationRequest], rounds: int, spec: str) -> list[float]:
    """The same round trips handed to the servicer in this process: the plugin's own work."""
    with tempfile.TemporaryDirectory(prefix="vc-bench-") as state:
        backend = SimulatedBackend(spec, "bench", Path(state))
        try:
            gpus = backend.gpus()
            service = DevicePluginService(
                gpus,
                backend.topology(),
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
        finally:
            backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--spec", default="8xH100-80GB")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vc-bench-", dir="/tmp"))
    try:
        with running_sim_node(args.spec, workdir) as (_agent, kubelet):
            run_rounds(kubelet, args.rounds, args.spec)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_rounds(kubelet: KubeletEmulator, rounds: int, spec: str) -> None:
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
    print(
        f"RESULT allocate_p50_ms={p50:.2f} allocate_p99_ms={p99:.2f} "
        f"grpc_floor_p50_ms={percentile(floor, 50):.2f} grpc_floor_p99_ms={percentile(floor, 99):.2f} "
        f"handler_p50_ms={percentile(handler, 50):.2f} handler_p99_ms={percentile(handler, 99):.2f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
