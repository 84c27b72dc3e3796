"""The control-plane steps around DRA allocation that the emulated cluster needs besides the API
server, acting on its store: a pod's claims made, allocated on a node and reserved for it.

- The resourceclaim controller's part: for each ``spec.resourceClaims`` entry of a pod naming a
  ResourceClaimTemplate, a ResourceClaim with the template's labels, annotations and spec, a
  generated name ``<pod>-<entry>-<5 characters>`` (both parts cut in proportion when that
  would pass 57 characters, as kube does), the annotation
  ``resource.kubernetes.io/pod-claim-name``, the pod as controlling owner, and the pod's
  ``status.resourceClaimStatuses`` pointing at it. An entry naming a ResourceClaim uses it.
- The scheduler's part of extended resources backed by DRA (KEP-5004): a container's request
  for a DeviceClass's ``extendedResourceName`` (or the implicit
  ``deviceclass.resource.kubernetes.io/<class>``), on a node whose allocatable does not offer
  that resource (a device plugin's), becomes one request ``container-<i>-request-<j>`` for
  exactly that many *devices* of the class (``count``, no capacity requests: each device
  consumes its request-policy defaults), in one claim per pod, generated name
  ``<pod>-extended-resources-…``, annotated ``resource.kubernetes.io/extended-resource-claim``,
  recorded in the pod's ``status.extendedResourceClaimStatus``; deleted again when it cannot
  be allocated.
- ``DraAllocator``: the allocation step (agent/emulators/draallocator.py) with the store's
  classes, slices and claims, written through the claim's status subresource; reservation of
  the claim for the pod (``status.reservedFor``); deallocation.

Not modelled: the controller's reaction to pod deletion (claims stay until deleted), claims
shared between pods beyond ``reservedFor``, ``spec.resourceClaims`` on pods created before the
template exists (an error here, a retry in kube), the scheduler's extended-resource claim
being created only at PreBind, and pod-level resources.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from agent.emulators.apiserver_query import ApiStatusError
from agent.emulators.apiserver_store import Store
from agent.emulators.draallocator import DraAllocationError, allocate_claim, claim_name
from agent.emulators.drapools import to_int

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_EXTENDED_PREFIX = "deviceclass.resource.kubernetes.io/"
_GENERATE_MAX = 57  # a 63-character name with a hyphen and 5 random characters


def generate_name(pod: str, entry: str) -> str:
    """The generateName of a claim for pod claim ``entry`` of ``pod``."""
    base = f"{pod}-{entry}-"
    if len(base) > _GENERATE_MAX:  # cut both in proportion, so neither is lost entirely
        keep_pod, keep_entry = (len(part) * _GENERATE_MAX // len(base) for part in (pod, entry))
        base = f"{pod[:keep_pod]}-{entry[:keep_entry]}-"
    return base


def owner_reference(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def claim_from_template(pod: Mapping[str, Any], entry: str, template: Mapping[str, Any]) -> dict[str, Any]:
    """The ResourceClaim the resourceclaim controller creates for ``entry`` of ``pod``."""
    source = template["spec"]
    meta = source.get("metadata") or {}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "generateName": generate_name(pod["metadata"]["name"], entry),
            "namespace": pod["metadata"]["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": {**(meta.get("annotations") or {}), POD_CLAIM_NAME_ANNOTATION: entry},
            "ownerReferences": [owner_reference(pod)],
        },
        "spec": copy.deepcopy(source["spec"]),
    }


def extended_resource_classes(classes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Extended resource name → DeviceClass name: the implicit name of every class, and each
    explicit ``extendedResourceName`` (the newest class wins a clash; at the same time, the
    name that sorts first)."""
    mapping = {
        f"{IMPLICIT_EXTENDED_PREFIX}{c['metadata']['name']}": str(c["metadata"]["name"]) for c in classes
    }
    ordered = sorted(classes, key=lambda c: str(c["metadata"]["name"]), reverse=True)
    ordered.sort(key=lambda c: str(c["metadata"].get("creationTimestamp") or ""))
    for klass in ordered:  # later entries overwrite: newest, then first by name
        name = (klass.get("spec") or {}).get("extendedResourceName")
        if name:
            mapping[str(name)] = str(klass["metadata"]["name"])
    return mapping


def extended_resource_claim(
    pod: Mapping[str, Any], mapping: Mapping[str, str], node_allocatable: Mapping[str, str]
) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
    """The claim the scheduler makes for the pod's DRA-backed extended resources on a node, and
    the pod's request mappings; None when it asks for none (or the node's device plugin serves
    them)."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    requests, mappings = [], []
    for i, container in enumerate(containers):
        resources = container.get("resources") or {}
        wanted = {
            **(resources.get("limits") or {}),
            **(resources.get("requests") or {}),
        }  # requests default to limits
        for j, resource in enumerate(sorted(wanted)):
            if resource not in mapping or to_int(node_allocatable.get(resource, "0"), resource) > 0:
                continue
            count = to_int(wanted[resource], f"container {container['name']}: {resource}")
            if count == 0:
                continue
            request = f"container-{i}-request-{j}"
            exactly = {"deviceClassName": mapping[resource], "allocationMode": "ExactCount", "count": count}
            requests.append({"name": request, "exactly": exactly})
            mappings.append(
                {"containerName": container["name"], "resourceName": resource, "requestName": request}
            )
    if not requests:
        return None
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "generateName": f"{pod['metadata']['name']}-extended-resources-",
            "namespace": pod["metadata"]["namespace"],
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            "ownerReferences": [owner_reference(pod)],
        },
        "spec": {"devices": {"requests": sorted(requests, key=lambda r: str(r["name"]))}},
    }
    return claim, mappings


def stored(store: Store, resource: str, namespace: str, name: str) -> dict[str, Any]:
    """The stored object; DraAllocationError naming it when there is none."""
    try:
        return store.get(resource, namespace, name)
    except ApiStatusError as err:
        raise DraAllocationError(f"{resource} {namespace}/{name}: {err}") from err


class DraAllocator:
    """The scheduler's DRA step against the fake API server's store (one claim at a time)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()  # two allocations must not both see the same free capacity

    def allocate(
        self, namespace: str, name: str, *, node: str | None = None, pod: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Allocate the claim (unless it is already) and reserve it for ``pod`` when given;
        returns the claim as stored. DraAllocationError when nothing fits."""
        with self._lock:
            claim = stored(self._store, "resourceclaims", namespace, name)
            status = copy.deepcopy(claim.get("status") or {})
            if not status.get("allocation"):
                uid = claim["metadata"]["uid"]
                others = [c for c in self._store.all("resourceclaims") if c["metadata"]["uid"] != uid]
                classes = {c["metadata"]["name"]: c for c in self._store.all("deviceclasses")}
                status["allocation"] = allocate_claim(
                    claim, classes, self._store.all("resourceslices"), others, node
                )
            if pod is not None:
                meta = pod["metadata"]
                ref = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
                reserved = status.setdefault("reservedFor", [])
                if ref not in reserved:
                    reserved.append(ref)
            return self._write_status(claim, status)

    def deallocate(self, namespace: str, name: str) -> dict[str, Any]:
        """Clear allocation and reservations (what happens once no pod uses the claim), freeing
        its capacity."""
        with self._lock:
            return self._write_status(stored(self._store, "resourceclaims", namespace, name), {})

    def _write_status(self, claim: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        precondition = meta["resourceVersion"]

        def change(current: dict[str, Any]) -> dict[str, Any]:
            metadata = {**current["metadata"], "resourceVersion": precondition}
            return {**current, "metadata": metadata, "status": status}

        try:
            stored = self._store.update("resourceclaims", meta["namespace"], meta["name"], change, "status")
        except ApiStatusError as err:
            raise DraAllocationError(f"cannot write the allocation of {claim_name(claim)}: {err}") from err
        return copy.deepcopy(stored)


class PodClaims:
    """A pod's claims, from its spec to allocated and reserved on a node (module docstring)."""

    def __init__(self, store: Store, allocator: DraAllocator | None = None) -> None:
        self._store = store
        self.allocator = allocator or DraAllocator(store)

    def admit(self, namespace: str, pod_name: str, node: str) -> list[dict[str, Any]]:
        """Every claim of the pod allocated on ``node`` and reserved for the pod; the claims as
        stored. DraAllocationError (and no extended-resource claim left behind) when one does
        not fit."""
        pod = stored(self._store, "pods", namespace, pod_name)
        claims = [
            self.allocator.allocate(namespace, c, node=node, pod=pod)
            for c in self.claim_names(namespace, pod_name)
        ]
        extended = self._extended_claim(pod, node)
        if extended is not None:
            try:
                claims.append(self.allocator.allocate(namespace, extended, node=node, pod=pod))
            except DraAllocationError:
                self._store.delete("resourceclaims", namespace, extended)
                self._set_pod_status(pod, "extendedResourceClaimStatus", None)
                raise
        return claims

    def claim_names(self, namespace: str, pod_name: str) -> list[str]:
        """The names of the pod's claims (``spec.resourceClaims``), created from templates where
        the pod has none yet."""
        pod = stored(self._store, "pods", namespace, pod_name)
        statuses = {
            s["name"]: s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        names = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            if entry.get("resourceClaimName"):
                names.append(str(entry["resourceClaimName"]))
                continue
            name = statuses.get(entry["name"])
            if not name:
                template_name = str(entry.get("resourceClaimTemplateName"))
                template = stored(self._store, "resourceclaimtemplates", namespace, template_name)
                name = self._store.create(
                    "resourceclaims", namespace, claim_from_template(pod, entry["name"], template)
                )["metadata"]["name"]
                statuses[entry["name"]] = name
                pod = self._set_pod_status(
                    pod,
                    "resourceClaimStatuses",
                    [{"name": k, "resourceClaimName": v} for k, v in statuses.items()],
                )
            names.append(str(name))
        return names

    def _extended_claim(self, pod: Mapping[str, Any], node: str) -> str | None:
        current = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
        if current.get("resourceClaimName"):
            return str(current["resourceClaimName"])
        try:
            allocatable = (self._store.get("nodes", "", node).get("status") or {}).get("allocatable") or {}
        except ApiStatusError:  # no Node object (a bare test cluster): nothing offered by a plugin
            allocatable = {}
        found = extended_resource_claim(
            pod, extended_resource_classes(self._store.all("deviceclasses")), allocatable
        )
        if found is None:
            return None
        manifest, mappings = found
        name = str(
            self._store.create("resourceclaims", pod["metadata"]["namespace"], manifest)["metadata"]["name"]
        )
        self._set_pod_status(
            pod, "extendedResourceClaimStatus", {"requestMappings": mappings, "resourceClaimName": name}
        )
        return name

    def _set_pod_status(self, pod: Mapping[str, Any], field: str, value: Any) -> dict[str, Any]:
        def change(current: dict[str, Any]) -> dict[str, Any]:
            status = {k: v for k, v in (current.get("status") or {}).items() if k != field}
            return {**current, "status": status if value is None else {**status, field: value}}

        meta = pod["metadata"]
        return self._store.update("pods", meta["namespace"], meta["name"], change, "status")
