"""How long a container can open a GPU that is not its own: the device guard alone (rules on
the container once the agent knows it) against the device gate (rules on the pod's cgroup
from the moment it appears), on a real containerd with runc (the real-runtime tier's
private containerd, tests/runtime).

Each round starts a container of a pod without GPUs that the runtime hands both GPU nodes
(NVIDIA_VISIBLE_DEVICES=all under the NVIDIA runtime); from its first instruction it opens
GPU 1 again and again for ``--seconds`` and logs each outcome (tests/runtime/gpuprobe.py).
The window is from its first attempt to the end of the last successful open (0: none
succeeded), at /proc/uptime's 10 ms resolution. Variants, each its own pods:

- ``before``: the guard alone, every 2 s (its default), told of the container as soon as
  ``ctr run`` returns (the best case: the agent really waits for the pod's status);
- ``after``: the gate, the pod's cgroup made before the container as kubelet makes it;
- ``race``: the gate, the runtime making the pod's cgroup together with the container's
  (no kubelet does this; the gate's reaction time against runc's create).

On cgroup v1 a gated container that is handed a GPU outside its pod's set does not start
(the kernel refuses runc's allow line): counted as ``refused``, window 0.

    flock /tmp/vc-heavy.lock .venv/bin/python bench/guard_window.py [--cells runc-v1,runc-v2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: the private containerd

from agent.control.deviceguard import DeviceGuard, GuardTarget
from agent.control.podgate import PodGate, gate_rules
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devicepolicy import DevicePolicy, DeviceRules, NvidiaMajors
from agent.platform.cgroups.devices_v1 import V1DeviceRules
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.paths import qos_dir_names
from agent.platform.cgroups.tree import remove_tree
from tests.runtime.conftest import _kubepods_dirs
from tests.runtime.containerd import PrivateContainerd, new_pod_uid
from tests.runtime.gpuprobe import controller, gpu_nodes, make_pod_cgroup, probe_result, resolver, start_probe

VARIANTS = ("before", "after", "race")


@contextmanager
def in_thread(run: Callable[[threading.Event], None], name: str) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def one_round(containerd: PrivateContainerd, uid: str, out: Path, seconds: float) -> tuple[str, int]:
    """(outcome, window ms) of one probe container in pod ``uid``."""
    nodes = gpu_nodes(containerd)
    try:
        box = start_probe(containerd, uid, nodes, str(nodes[1]), out=out, seconds=seconds)
    except RuntimeError as err:
        if "operation not permitted" not in str(err).lower():
            raise
        return "refused", 0
    result = probe_result(out, seconds + 30)
    containerd.ctr("task", "kill", "--signal", "SIGKILL", box.id, check=False)
    return f"{result.allowed}/{result.attempts} opens", result.window_ms


def run_cell(
    runtime: str, cgroup: str, rounds: int, seconds: float, bpf: BpfDeviceRules | None
) -> dict[str, list[int]]:
    workdir = Path(tempfile.mkdtemp(prefix="vc-gw-", dir="/tmp"))
    containerd = PrivateContainerd(workdir, runtime=runtime, cgroup=cgroup)
    containerd.start()
    windows: dict[str, list[int]] = {v: [] for v in VARIANTS}
    try:
        rules: DeviceRules = V1DeviceRules() if cgroup == "v1" else bpf  # type: ignore[assignment]
        root = resolver(containerd).kubepods_root(controller(containerd))
        for name in qos_dir_names(CgroupDriver.CGROUPFS):
            (root / name).mkdir(parents=True, exist_ok=True)  # kubelet makes these at its start
        known: list[GuardTarget] = []
        guard = DeviceGuard(lambda: list(known), resolver(containerd), rules, interval_s=2.0)
        no_gpu = DevicePolicy(None)
        ours: set[str] = set()  # kubepods is the host's: other pods there are left alone

        def verdict(uid: str) -> DevicePolicy | None:
            return no_gpu if uid in ours else None

        gate = PodGate(verdict, resolver(containerd), gate_rules(rules), interval_s=2.0)
        with in_thread(guard.run, "device-guard"):
            for variant in VARIANTS:
                context = in_thread(gate.run, "device-gate") if variant != "before" else _nothing()
                with context:
                    if variant != "before" and not gate.watching.wait(10):
                        raise RuntimeError("the gate did not start watching")
                    for i in range(rounds):
                        uid = new_pod_uid()
                        ours.add(uid)
                        if variant == "after":
                            make_pod_cgroup(containerd, uid)
                        out = workdir / f"{variant}-{i}"
                        outcome, window = _round_with_target(containerd, uid, out, seconds, known)
                        windows[variant].append(window)
                        cell = f"{runtime}-{cgroup}"
                        print(f"{cell} {variant:6} round {i}: {outcome}, window {window} ms", flush=True)
    finally:
        containerd.stop()
    return windows


def _round_with_target(
    containerd: PrivateContainerd, uid: str, out: Path, seconds: float, known: list[GuardTarget]
) -> tuple[str, int]:
    """The round, with the guard told of the container once ``ctr run`` returned."""
    before = len(containerd.containers)
    started = threading.Event()

    def tell() -> None:  # ctr run returns once the task runs: the earliest the agent could know
        while not started.wait(0.005):
            if len(containerd.containers) > before:
                box = containerd.containers[-1]
                known.append(GuardTarget(uid, box.qos, box.id, None, f"bench/{uid[:8]}/main"))
                return

    teller = threading.Thread(target=tell, daemon=True)
    teller.start()
    try:
        return one_round(containerd, uid, out, seconds)
    finally:
        started.set()
        teller.join()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", default="runc-v1,runc-v2", help="runtime-cgroup pairs (also crun-v1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each probe keeps opening")
    args = parser.parse_args()
    cells = [tuple(c.split("-", 1)) for c in args.cells.split(",")]
    existing = {p for p in _kubepods_dirs() if p.exists()}
    bpf = None
    if any(cgroup == "v2" for _, cgroup in cells):
        bpf = BpfDeviceRules(NvidiaMajors())
        bpf.load()
    results: dict[str, list[int]] = {v: [] for v in VARIANTS}
    try:
        for runtime, cgroup in cells:
            for variant, values in run_cell(runtime, cgroup, args.rounds, args.seconds, bpf).items():
                results[variant] += values
    finally:
        if bpf is not None:
            bpf.close()
        for top in _kubepods_dirs():
            if top.exists() and top not in existing:
                remove_tree(top)
    print(
        f"RESULT guard_window_ms={max(results['after'])} guard_window_before_ms={max(results['before'])} "
        f"guard_window_race_ms={max(results['race'])} rounds={args.rounds} cells={args.cells}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
