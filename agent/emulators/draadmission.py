"""DRA admission on the enforced simulated node (agent/emulators/enforcednode.py), for the
demo, tests and the DRA benchmark: what kube-scheduler and kubelet do for a pod whose GPU
comes from a ResourceClaim of the driver gpu.vcuda.io.

``ClaimPods.run`` creates a ResourceClaimTemplate (cores, memory, ShareConfig) and a pod bound
to the node that uses it; the emulated allocator (agent/emulators/draclaims.py) makes the
claim and allocates it from the agent's ResourceSlice; the kubelet DRA emulator calls the
agent's NodePrepareResources over its real socket; the CDI device IDs it answers are resolved
from the spec files the agent wrote, as a CDI-enabled runtime does (environment and mounts;
device nodes do not exist here); then the pod is reported Running and its workload started in
its container cgroup with that environment. Not modelled: the scheduler's filtering and
scoring (the node is given), claim deallocation when the pod ends, CDI hooks, the runtime's
own device rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.domain.dra import CONFIG_API_VERSION, CONFIG_KIND, DRIVER, claim_ref, claim_shares
from agent.emulators.cluster import container_id
from agent.emulators.containers import RunningContainer
from agent.emulators.draclaims import PodClaims
from agent.emulators.enforcednode import NODE, EnforcedNode, wait_for
from agent.emulators.kubelet_dra import KubeletDraEmulator, container_cdi_ids
from agent.errors import PlatformError
from agent.platform.cgroups.paths import QosClass

DEVICE_CLASS = "vcuda-gpu"


def device_class() -> dict[str, Any]:
    """The DeviceClass of deploy/overlays/dra, as the admin installs it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
    }


def claim_template(
    name: str, cores: int, memory_mib: int, policy: str | None, limit: int | None
) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND}
    if policy is not None:
        parameters["policy"] = policy
    if limit is not None:
        parameters["limit"] = limit
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DEVICE_CLASS,
                                "capacity": {"requests": {"cores": str(cores), "memory": f"{memory_mib}Mi"}},
                            },
                        }
                    ],
                    "config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}],
                }
            }
        },
    }


def claim_pod(name: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu", "request": "gpu"}]}}
            ],
        },
    }


def resolve_cdi(cdi_dir: Path, ids: list[str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(environment, mounts) the CDI devices ``ids`` (``kind=name``) add to a container."""
    devices: dict[str, Mapping[str, Any]] = {}
    for path in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        for device in spec.get("devices") or []:
            devices[f"{spec['kind']}={device['name']}"] = device.get("containerEdits") or {}
    envs: dict[str, str] = {}
    mounts: list[tuple[str, str]] = []
    for cdi_id in ids:
        if cdi_id not in devices:
            raise PlatformError(f"CDI device {cdi_id} is in no spec under {cdi_dir}")
        edits = devices[cdi_id]
        envs.update(dict(entry.split("=", 1) for entry in edits.get("env") or []))
        mounts += [(m["containerPath"], m["hostPath"]) for m in edits.get("mounts") or []]
    return envs, mounts


@dataclass
class ClaimPod:
    name: str
    claim: dict[str, Any]  # the ResourceClaim as allocated
    gpu: int
    box: RunningContainer


class ClaimPods:
    def __init__(self, node: EnforcedNode, kubelet: KubeletDraEmulator, cdi_dir: Path) -> None:
        self.node = node
        self.kubelet = kubelet
        self.cdi_dir = cdi_dir
        self.claims = PodClaims(node.api.store)
        if node.api.get_object("deviceclasses", DEVICE_CLASS) is None:
            node.api.create_object("deviceclasses", device_class())

    def wait_for_slice(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The agent's ResourceSlice, once published (the allocator reads it)."""
        found: dict[str, Any] = wait_for(
            lambda: next(iter(self.node.api.objects("resourceslices")), None),
            timeout_s,
            "the agent's ResourceSlice",
        )
        return found

    def run(
        self,
        name: str,
        cores: int,
        memory_mib: int,
        *,
        policy: str | None = "fixed-share",
        limit: int | None = None,
        busy: float = 1.0,
    ) -> ClaimPod:
        """Allocate, prepare and start the pod's one container; returns once it runs on its GPU."""
        api = self.node.api
        template = claim_template(name, cores, memory_mib, policy, limit)
        api.create_object("resourceclaimtemplates", template, "default")
        pod = self.node.node.create_pod(claim_pod(name, name))
        [claim] = self.claims.admit("default", name, NODE)
        ref = claim_ref(claim)
        result = self.kubelet.prepare(DRIVER, [ref])[ref.uid]
        if result.error:
            raise PlatformError(f"NodePrepareResources for {ref.key}: {result.error}")
        # What kubelet gives container "c", which names the pod claim's request "gpu".
        envs, mounts = resolve_cdi(self.cdi_dir, container_cdi_ids(result, "gpu"))
        [share] = claim_shares(claim, NODE)
        self.node.node.mark_running(pod)
        stored = api.pod("default", name)
        assert stored is not None
        box = self.node.runtime.start(
            f"default/{name}/c",
            pod_uid=pod.uid,
            qos=QosClass(stored["status"]["qosClass"]),
            container_id=container_id(pod.uid, "c"),
            gpu=share.gpu_index,
            busy=busy,
            envs=envs,
            mounts=mounts,
        )
        wait_for(
            lambda: self.node.on_gpu(box) or box.proc.poll() is not None, 30, f"{name}'s workload on its GPU"
        )
        if box.proc.poll() is not None:
            raise PlatformError(
                f"the workload of {name} exited with {box.proc.returncode} before reaching its GPU"
            )
        return ClaimPod(name, claim, share.gpu_index, box)
