"""Compute-cap accuracy on a real NVIDIA GPU: real NVML, real freezer, a CUDA matmul loop per
container (a train-like pattern). The same scenarios and table as bench/enforcement.py; CI
does not run it.

Each scenario starts the agent on the machine's GPUs (no ``--simulate``) in Kubernetes
mode against the emulated API server and kubelet, admits the pods through the real device
plugin, and starts each container's workload (``python -c <matmul loop>`` with PyTorch) in
its own cgroup v2 directory, with ``CUDA_VISIBLE_DEVICES`` set to the GPU kubelet gave it.
What each container got is read from NVML's per-process samples (``process_samples``),
turned into time-weighted utilization by the agent's own estimator over 0.5 s windows.

``--actuator mps`` (or ``auto``) runs the agent in sharing mode mps: it starts
``nvidia-cuda-mps-control -f`` for the GPU and each container gets its MPS limits from
Allocate (the runtime emulator passes Allocate's CUDA_* variables, pipe directory
included). NVIDIA documents that NVML then credits MPS clients' work to the MPS server,
so in that mode what each container got is read from its own progress instead: the matmul
loop counts its iterations, and a first run of one container alone on the whole GPU (no
MPS) gives the iterations per second of 100 %.

Needs: root, an NVIDIA driver, ``pip install torch`` in the venv (PyTorch with CUDA), and
for MPS the driver's ``nvidia-cuda-mps-control`` on PATH.

    sudo .venv/bin/python bench/gpu_enforcement.py [--seconds 25] [--settle 5] [--actuator mps]

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
import os, sys, time, torch
a = torch.randn(4096, 4096, device="cuda")
b = torch.randn(4096, 4096, device="cuda")
progress, count, last = sys.argv[1] if len(sys.argv) > 1 else "", 0, 0.0
while True:
    c = a @ b
    torch.cuda.synchronize()
    count += 1
    if progress and time.monotonic() - last > 0.1:
        last = time.monotonic()
        with open(progress + ".tmp", "w") as f:
            f.write(f"{count} {last}")
        os.replace(progress + ".tmp", progress)
"""
CALIBRATE_S = 8.0
PROGRESS_TOO = False  # set from --progress-too
# Neither BPF program is needed to hold caps; a lent GPU machine may have no bcc.
GPU_NODE_ARGS = ("--device-guard", "off", "--no-ioctl-tracing")


def start_workload(node: EnforcedNode, name: str, box: Box) -> tuple[int, int]:
    """(pid, GPU index) of the container's CUDA workload; it writes its progress (iterations,
    monotonic time) to ``<workdir>/<name>.progress``."""
    admission = node.node.run_pod(pod_manifest(name, box.cores, 2048, {POLICY: box.policy}))
    response = admission.containers[0].response
    pod = node.api.pod("default", name)
    assert pod is not None
    uuid = admission.containers[0].response.envs["VCUDA_GPU_UUIDS"].split(",")[0]
    running = node.runtime.start(
        f"default/{name}/c",
        pod_uid=admission.pod.uid,
        qos=QosClass(pod["status"]["qosClass"]),
        container_id=container_id(admission.pod.uid, "c"),
        gpu=0,
        command=[
            sys.executable,
            "-c",
            f"import os; os.environ['CUDA_VISIBLE_DEVICES'] = '{uuid}'\n{MATMUL}",
            str(node.workdir / f"{name}.progress"),
        ],
        envs=dict(response.envs),
        mounts=[(m.container_path, m.host_path) for m in response.mounts],
    )
    backend = open_nvml_backend()
    try:
        index = next(g.index for g in backend.gpus() if g.uuid == uuid)
        progress = node.workdir / f"{name}.progress"
        wait_for(
            lambda: progress.exists() or any(p.pid == running.pid for p in backend.process_memory(index)),
            60,
            f"{name} on the GPU",
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


def progress_rates(
    files: list[Path], seconds: float, full_rate: float
) -> tuple[list[list[float]], list[float]]:
    """Per container, its iterations per WINDOW_S window as percent of ``full_rate``."""
    series: list[list[float]] = [[] for _ in files]
    starts: list[float] = []
    last = [_read_progress(f) for f in files]
    stop = threading.Event()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        starts.append(time.monotonic())
        stop.wait(WINDOW_S)
        now = [_read_progress(f) for f in files]
        for i, ((n0, t0), (n1, t1)) in enumerate(zip(last, now, strict=True)):
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
            series[i].append(100 * rate / full_rate)
        last = now
    return series, starts


def _read_progress(path: Path) -> tuple[int, float]:
    try:
        count, at = path.read_text().split()
        return int(count), float(at)
    except (OSError, ValueError):
        return 0, time.monotonic()


_FULL_RATE: list[float] = []  # iterations per second of the matmul alone on the whole GPU


def full_rate(workdir: Path) -> float:
    """Calibration, once: one container on a whole GPU, no MPS, no cap."""
    if not _FULL_RATE:
        with enforced_node(
            workdir / "calibrate", None, agent_args=("--log-level", "WARNING", *GPU_NODE_ARGS)
        ) as node:
            start_workload(node, "pod-alone", Box("alone", 100, "fixed-share"))
            progress = node.workdir / "pod-alone.progress"
            time.sleep(2)
            (n0, t0) = _read_progress(progress)
            time.sleep(CALIBRATE_S)
            (n1, t1) = _read_progress(progress)
        _FULL_RATE.append((n1 - n0) / (t1 - t0))
        print(f"# calibration: {_FULL_RATE[0]:.1f} matmuls/s alone on the whole GPU", flush=True)
    return _FULL_RATE[0]


def run_scenario(boxes: list[Box], _spec: PatternSpec, args: argparse.Namespace, workdir: Path) -> Run:
    agent_args = ("--log-level", "WARNING", "--sharing-mode", args.actuator, *GPU_NODE_ARGS)
    rate = full_rate(workdir.parent) if args.actuator != "freezer" else 0.0
    if args.actuator == "freezer" and PROGRESS_TOO:
        rate = full_rate(workdir.parent)
    with enforced_node(workdir, None, agent_args=agent_args) as node:
        pids = [start_workload(node, f"pod-{b.name}", b) for b in boxes]
        files = [node.workdir / f"pod-{b.name}.progress" for b in boxes]
        if args.actuator == "freezer":
            by_progress: list[Run] = []
            if PROGRESS_TOO:  # the same windows by the second yardstick, side by side
                thread = threading.Thread(
                    target=lambda: by_progress.append(Run(*progress_rates(files, args.seconds, rate)))
                )
                thread.start()
            windows, starts = sample(pids, args.seconds)
            if PROGRESS_TOO:
                thread.join()
                _print_both(boxes, Run(windows, starts), by_progress[0], args.settle)
        else:  # NVML credits MPS clients' work to the MPS server: read their progress
            windows, starts = progress_rates(files, args.seconds, rate)
    return Run(windows, starts)


def _print_both(boxes: list[Box], nvml: Run, progress: Run, settle: float) -> None:
    """Each container's mean after ``settle`` by NVML's samples and by its own throughput."""
    skip = int(settle / WINDOW_S)
    for i, box in enumerate(boxes):
        by_nvml, by_rate = nvml.windows[i][skip:], progress.windows[i][skip:]
        print(
            f"# {box.name}: {box.policy} {box.cores}: NVML {sum(by_nvml) / max(len(by_nvml), 1):.1f} %, "
            f"throughput {sum(by_rate) / max(len(by_rate), 1):.1f} % of the loop alone",
            flush=True,
        )


if __name__ == "__main__":
    # --progress-too (freezer): also read each container's throughput, printed beside NVML's view.
    argv = [a for a in sys.argv[1:] if a != "--progress-too"]
    PROGRESS_TOO = len(argv) != len(sys.argv) - 1
    raise SystemExit(main(["--pattern", "train", *argv], real=run_scenario))
