"""Compute-cap accuracy on a real NVIDIA GPU: real NVML, real freezer, a CUDA matmul loop per
container (a train-like pattern). The same scenarios and table as bench/enforcement.py; CI
does not run it.

Each scenario starts the agent on the machine's GPUs (no ``--simulate``) in Kubernetes
mode against the emulated API server and kubelet, admits the pods through the real device
plugin, and starts each container's workload (``python -c <matmul loop>`` with PyTorch) in
its own cgroup v2 directory, with ``CUDA_VISIBLE_DEVICES`` set to the GPU kubelet gave it.
What each container got is read from NVML's per-process samples (``process_samples``),
turned into time-weighted utilization by the agent's own estimator over 0.5 s windows.

Needs: root, an NVIDIA driver, ``pip install torch`` in the venv (PyTorch with CUDA).

    sudo .venv/bin/python bench/gpu_enforcement.py [--seconds 25] [--settle 5]

Last line: as bench/enforcement.py's (the pattern column reads ``train``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from enforcement import WINDOW_S, main
from enforcement_model import Box, Run

from agent.domain.annotations import POLICY
from agent.domain.usage import GpuUsageEstimator
from agent.emulators.cluster import container_id
from agent.emulators.enforcednode import EnforcedNode, enforced_node, pod_manifest, wait_for
from agent.platform.cgroups.paths import QosClass
from agent.platform.gpu.nvml import open_nvml_backend
from agent.platform.gpu.sim.programs import PatternSpec

# Short kernels back to back, each waited for: the pattern the duty cycle follows closely.
MATMUL = """
import torch
a = torch.randn(4096, 4096, device="cuda")
b = torch.randn(4096, 4096, device="cuda")
while True:
    c = a @ b
    torch.cuda.synchronize()
"""


def start_workload(node: EnforcedNode, name: str, box: Box) -> tuple[int, int]:
    """(pid, GPU index) of the container's CUDA workload."""
    admission = node.node.run_pod(pod_manifest(name, box.cores, 2048, {POLICY: box.policy}))
    pod = node.api.pod("default", name)
    assert pod is not None
    uuid = admission.containers[0].response.envs["VCUDA_GPU_UUIDS"].split(",")[0]
    running = node.runtime.start(
        f"default/{name}/c",
        pod_uid=admission.pod.uid,
        qos=QosClass(pod["status"]["qosClass"]),
        container_id=container_id(admission.pod.uid, "c"),
        gpu=0,
        command=[sys.executable, "-c", f"import os; os.environ['CUDA_VISIBLE_DEVICES'] = '{uuid}'\n{MATMUL}"],
    )
    backend = open_nvml_backend()
    try:
        index = next(g.index for g in backend.gpus() if g.uuid == uuid)
        wait_for(
            lambda: any(p.pid == running.pid for p in backend.process_memory(index)), 60, f"{name} on the GPU"
        )
    finally:
        backend.close()
    return running.pid, index


def sample(pids: list[tuple[int, int]], seconds: float) -> tuple[list[list[float]], list[float]]:
    """Per container, its NVML utilization in each WINDOW_S window."""
    backend = open_nvml_backend()
    estimators = {index: GpuUsageEstimator[int](window_s=WINDOW_S) for _, index in pids}
    since = dict.fromkeys(estimators, 0)
    series: list[list[float]] = [[] for _ in pids]
    starts: list[float] = []
    stop = threading.Event()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            starts.append(time.monotonic())
            stop.wait(WINDOW_S)
            for index, estimator in estimators.items():
                samples = backend.process_samples(index, since[index])
                if samples:
                    since[index] = max(s.timestamp_us for s in samples)
                estimator.add_samples((s.pid, s.pid, s.timestamp_us, float(s.sm_util)) for s in samples)
            for i, (pid, index) in enumerate(pids):
                series[i].append(estimators[index].estimate(time.time()).by_key.get(pid, 0.0))
    finally:
        backend.close()
    return series, starts


def run_scenario(boxes: list[Box], _spec: PatternSpec, args: argparse.Namespace, workdir: Path) -> Run:
    with enforced_node(workdir, None, agent_args=("--log-level", "WARNING")) as node:
        pids = [start_workload(node, f"pod-{b.name}", b) for b in boxes]
        windows, starts = sample(pids, args.seconds)
    return Run(windows, starts)


if __name__ == "__main__":
    raise SystemExit(main(["--pattern", "train", *sys.argv[1:]], real=run_scenario))
