"""One emulated Kubernetes node for the demo and tests: the fake API server plus the
kubelet emulator, doing what kubelet does with a pod bound to the node.

``run_pod`` creates the pod (bound to the node, Pending) in the API server, admits it
through the kubelet emulator (the agent's device plugin is called exactly as kubelet
calls it), then reports it Running with container IDs, or Failed with kubelet's
UnexpectedAdmissionError when admission fails. ``finish_pod`` and ``delete_pod`` end it
and release its devices. Not modelled: the scheduler (pods are created already bound
unless the caller binds them), container start-up, restarts, probes, image pulls.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.kubelet import AdmissionError, KubeletEmulator, PodAdmission
from agent.emulators.pods import PodSpec, pod_from_manifest


def container_id(pod_uid: str, container: str) -> str:
    """A stable 64-hex container ID, as containerd makes them."""
    return hashlib.sha256(f"{pod_uid}/{container}".encode()).hexdigest()


class EmulatedNode:
    def __init__(self, api: FakeApiServer, kubelet: KubeletEmulator, node_name: str) -> None:
        self.api = api
        self.kubelet = kubelet
        self.node_name = node_name
        self.admitted: dict[str, PodSpec] = {}  # "ns/name" -> spec

    def create_pod(self, manifest: Mapping[str, Any]) -> PodSpec:
        """Create the pod bound to this node (what the scheduler's Binding leads to)."""
        body = copy.deepcopy(dict(manifest))
        body.setdefault("spec", {})["nodeName"] = self.node_name
        return pod_from_manifest(self.api.create_pod(body))

    def admit(self, pod: PodSpec) -> PodAdmission:
        """kubelet's admission of a pod that is bound to this node."""
        try:
            admission = self.kubelet.admit(pod)
        except AdmissionError as err:
            self.api.set_pod_phase(pod.namespace, pod.name, "Failed")
            raise AdmissionError(f"pod {pod.key}: {err}") from err
        self.mark_running(pod)
        return admission

    def mark_running(self, pod: PodSpec) -> None:
        """kubelet started the admitted pod's containers: Running, with container IDs (tests
        that drive admission step by step call it themselves)."""
        ids = {c.name: f"containerd://{container_id(pod.uid, c.name)}" for c in pod.containers}
        self.api.set_pod_phase(pod.namespace, pod.name, "Running", ids)
        self.admitted[pod.key] = pod

    def run_pod(self, manifest: Mapping[str, Any]) -> PodAdmission:
        return self.admit(self.create_pod(manifest))

    def finish_pod(self, namespace: str, name: str, phase: str = "Succeeded") -> None:
        self.api.set_pod_phase(namespace, name, phase)
        self._release(namespace, name)

    def delete_pod(self, namespace: str, name: str) -> None:
        self.api.delete_pod(namespace, name)
        self._release(namespace, name)

    def _release(self, namespace: str, name: str) -> None:
        pod = self.admitted.pop(f"{namespace}/{name}", None)
        if pod is not None:
            self.kubelet.release(pod)
