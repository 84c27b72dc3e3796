"""What the scheduler extender's bind needs from the API: read a pod, patch its annotations
with a resourceVersion precondition, create its Binding (PodWriter plus a read)."""

from __future__ import annotations

from agent.platform.kube.client import json_call
from agent.platform.kube.pods import PodInfo, pod_from_json
from agent.platform.kube.podwriter import PodWriter


class PodBindingClient(PodWriter):
    """``PodWriter`` (patch_annotations, bind) and ``get``; errors are KubeError."""

    def get(self, namespace: str, name: str) -> PodInfo:
        """The pod as the server has it now; KubeError(status=404) when it does not exist."""
        body = json_call(
            f"read pod {namespace}/{name}",
            lambda: self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return pod_from_json(body)
