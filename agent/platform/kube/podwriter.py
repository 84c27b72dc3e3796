"""Writes to pods: annotation patches (optionally conditional on a resourceVersion) and bindings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api, V1Binding

from agent.platform.kube.client import json_call
from agent.platform.kube.pods import PodInfo, pod_from_json

_MERGE_PATCH = "application/merge-patch+json"


class PodWriter:
    """Patches pod annotations and binds pods, translating API errors into KubeError."""

    def __init__(self, api: ApiClient, request_timeout_s: float = 10.0) -> None:
        self._core = CoreV1Api(api)
        self._timeout = request_timeout_s

    def patch_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> PodInfo:
        """Merge-patch annotations (None deletes a key) and return the pod as the server has it.

        With ``resource_version`` the patch applies only to that version of the pod:
        ConflictError (409) when the pod has changed since; KubeError(status=404) when it is gone.
        """
        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if resource_version:
            meta["resourceVersion"] = resource_version
        body = json_call(
            f"patch annotations of pod {namespace}/{name}",
            lambda: self._core.patch_namespaced_pod(
                name,
                namespace,
                {"metadata": meta},
                _content_type=_MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
        )
        return pod_from_json(body)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind the pod to ``node`` (what a scheduler does); ConflictError if it is bound already
        or ``uid`` is no longer the pod's uid."""
        binding = V1Binding.model_validate(
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
        )
        json_call(
            f"bind pod {namespace}/{name} to node {node}",
            lambda: self._core.create_namespaced_pod_binding(
                name, namespace, binding, _preload_content=False, _request_timeout=self._timeout
            ),
        )
