"""ResourceSlices (resource.k8s.io/v1, cluster-scoped) of one DRA driver on one node: list,
create, replace (conditional on a resourceVersion) and delete, as raw JSON.

The typed ``ResourceV1Api`` is used for its paths and auth; bodies go through the client's
model (``V1ResourceSlice.model_validate``), which keeps every field of a v1 slice, and answers
are read as JSON with ``_preload_content=False`` like the other adapters here. Every failure is
a KubeError (ConflictError on 409, ``status`` 404 when the slice is gone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.client import ApiClient, ResourceV1Api, V1DeleteOptions, V1ResourceSlice

from agent.errors import KubeError
from agent.platform.kube.client import json_call


class ResourceSliceClient:
    """The slices that ``driver`` publishes for ``node_name``."""

    def __init__(self, api: ApiClient, node_name: str, driver: str, request_timeout_s: float = 10.0) -> None:
        self.node_name = node_name
        self.driver = driver
        self._resource = ResourceV1Api(api)
        self._timeout = request_timeout_s

    def list(self) -> list[dict[str, Any]]:
        """This node's slices of this driver (both are field selectors the API server supports)."""
        body = json_call(
            f"list ResourceSlices of {self.driver} on node {self.node_name}",
            lambda: self._resource.list_resource_slice(
                field_selector=f"spec.nodeName={self.node_name},spec.driver={self.driver}",
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
        )
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise KubeError("the ResourceSlice list has no items")
        return [item for item in items if isinstance(item, dict)]

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create; ConflictError (409) when a slice of that name exists."""
        model = _model(obj)
        created: dict[str, Any] = json_call(
            f"create ResourceSlice {_name(obj)}",
            lambda: self._resource.create_resource_slice(
                model, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return created

    def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the whole slice; with metadata.resourceVersion set, ConflictError when the stored
        slice has changed since."""
        name, model = _name(obj), _model(obj)
        replaced: dict[str, Any] = json_call(
            f"replace ResourceSlice {name}",
            lambda: self._resource.replace_resource_slice(
                name, model, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return replaced

    def delete(self, name: str, resource_version: str | None = None) -> bool:
        """Delete ``name``; False when it was already gone. With ``resource_version`` only that
        version is deleted (ConflictError otherwise)."""
        options = V1DeleteOptions.model_validate(
            {"preconditions": {"resourceVersion": resource_version}} if resource_version else {}
        )
        try:
            json_call(
                f"delete ResourceSlice {name}",
                lambda: self._resource.delete_resource_slice(
                    name, body=options, _preload_content=False, _request_timeout=self._timeout
                ),
            )
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        return True


def _name(obj: Mapping[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise KubeError("a ResourceSlice without metadata.name cannot be written")
    return name


def _model(obj: Mapping[str, Any]) -> V1ResourceSlice:
    """The client's model of the slice; a body it cannot represent is refused before sending."""
    try:
        return V1ResourceSlice.model_validate(dict(obj))
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise KubeError(f"ResourceSlice {_name(obj)} is not a valid v1 object: {err}") from err
