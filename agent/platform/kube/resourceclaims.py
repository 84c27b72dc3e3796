"""Reading ResourceClaims (``resource.k8s.io/v1``) for the DRA kubelet plugin.

kubelet names a claim by namespace, name and UID; the plugin reads the object itself for
its allocation (GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>),
the only read NodePrepareResources needs (RBAC: resourceclaims get).
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import ApiClient, ResourceV1Api

from agent.errors import KubeError
from agent.platform.kube.client import json_call


class ResourceClaimClient:
    def __init__(self, api: ApiClient, request_timeout_s: float = 10.0) -> None:
        self._resource = ResourceV1Api(api)
        self._timeout = request_timeout_s

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim as JSON; KubeError (status 404 when it does not exist) if it cannot be read."""
        body = json_call(
            f"read ResourceClaim {namespace}/{name}",
            lambda: self._resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        if not isinstance(body, dict):
            raise KubeError(
                f"read ResourceClaim {namespace}/{name}: the API server sent {type(body).__name__}"
            )
        return body
