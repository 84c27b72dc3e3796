"""The demo's DRA story, inside the live act: the agent runs with ``--dra --dra-gpus 2``, so
GPU 2 is served as the DRA driver gpu.vcuda.io while GPUs 0 and 1 keep the device plugin. A
ResourceClaimTemplate asks for 30 cores and 4 GiB; the emulated scheduler allocates the pod's
claim from the agent's ResourceSlice, the emulated kubelet prepares it over the agent's DRA
socket, the workload starts with what the CDI spec says, and the table shows it held at 30 %
like every other share (agent/emulators/draadmission.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from agent.domain.dra import DRIVER
from agent.emulators.draadmission import ClaimPod, ClaimPods
from agent.emulators.enforcednode import EnforcedNode
from agent.emulators.kubelet_dra import KubeletDraEmulator

DRA_GPU = 2
CLAIM_POD = "dra-claim-30"
CLAIM_CORES, CLAIM_MIB = 30, 4096


@dataclass(frozen=True)
class DraDirs:
    registry: Path
    plugin: Path
    cdi: Path

    def agent_args(self) -> tuple[str, ...]:
        return (
            "--dra",
            "--dra-gpus",
            str(DRA_GPU),
            "--dra-registry-dir",
            str(self.registry),
            "--dra-plugin-dir",
            str(self.plugin),
            "--cdi-dir",
            str(self.cdi),
        )


@contextlib.contextmanager
def dra_kubelet(workdir: Path) -> Iterator[tuple[DraDirs, KubeletDraEmulator]]:
    """kubelet's plugin watcher and DRA manager, watching before the agent starts."""
    dirs = DraDirs(workdir / "plugins_registry", workdir / "dra", workdir / "cdi")
    kubelet = KubeletDraEmulator(dirs.registry)
    kubelet.start()
    try:
        yield dirs, kubelet
    finally:
        kubelet.stop()


def start_claim(node: EnforcedNode, kubelet: KubeletDraEmulator, dirs: DraDirs, console: Console) -> ClaimPod:
    kubelet.wait_for_plugin(DRIVER, timeout_s=30)
    pods = ClaimPods(node, kubelet, dirs.cdi)
    published = pods.wait_for_slice()
    devices = published["spec"]["devices"]
    capacity = devices[0]["capacity"]
    console.print(
        f"DRA: the agent published ResourceSlice {published['metadata']['name']} with "
        f"{', '.join(d['name'] for d in devices)} (cores {capacity['cores']['value']}, "
        f"memory {capacity['memory']['value']}); GPUs 0-1 stay with the device plugin"
    )
    pod = pods.run(CLAIM_POD, CLAIM_CORES, CLAIM_MIB, policy="fixed-share")
    [result] = pod.claim["status"]["allocation"]["devices"]["results"]
    consumed = result.get("consumedCapacity") or {}
    console.print(
        f"DRA: claim {pod.claim['metadata']['name']} allocated on {result['device']} "
        f"(consumed cores {consumed.get('cores')}, memory {consumed.get('memory')}), prepared by the "
        f"agent (CDI spec in {dirs.cdi}); pod {CLAIM_POD} runs on GPU {pod.gpu}, held at its 30 %"
    )
    return pod
