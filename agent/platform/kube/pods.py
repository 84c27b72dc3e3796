"""The agent's view of a Pod, parsed from the API's JSON (no kubernetes model objects:
parsing the few fields we use is far cheaper than the client's deserializer)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.errors import PodFormatError
from agent.platform.kube.podsecurity import NO_SPEC, root_risk

CORE_RESOURCE = "nvidia.com/vcuda-core"
MEMORY_RESOURCE = "nvidia.com/vcuda-memory"
FINISHED_PHASES = ("Succeeded", "Failed")

_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_FACTORS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def int_quantity(text: str) -> int:
    """An extended-resource quantity (an integer, optionally with a suffix) as an int."""
    match = _QUANTITY.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not an integer quantity")
    return int(match.group(1)) * _FACTORS[match.group(2)]


# The pod claim name under which resource_claims lists the claim made for its extended
# resources (not a valid DNS label, so no claim of the pod's own can have it).
EXTENDED_CLAIM = "<extended-resources>"


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    index: int  # position in spec.containers, or in spec.initContainers when ``init``
    init: bool
    resources: Mapping[str, str] = field(default_factory=dict)  # limits over requests, as written
    container_id: str = ""  # status containerID without the scheme ("" until it started)
    runtime: str = ""  # the scheme of containerID: "containerd", "cri-o", "docker"
    claims: tuple[str, ...] = ()  # resources.claims[].name: the pod's DRA claims it uses
    # Why its spec does not prove it can neither run as root nor become root (None: proven).
    root_risk: str | None = NO_SPEC

    def quantity(self, resource: str) -> int:
        """The integer quantity of ``resource`` (0 if absent); ValueError if malformed."""
        text = self.resources.get(resource)
        return 0 if text is None else int_quantity(text)

    @property
    def wants_gpu(self) -> bool:
        return CORE_RESOURCE in self.resources


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    node_name: str = ""
    phase: str = "Pending"
    created: float = 0.0  # creationTimestamp, seconds since the epoch
    deleting: bool = False  # deletionTimestamp is set
    resource_version: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    containers: tuple[ContainerInfo, ...] = ()  # init containers first, then app containers
    qos_class: str = "BestEffort"
    scheduler_name: str = "default-scheduler"  # spec.schedulerName
    # Pod claim name -> ResourceClaim name (spec.resourceClaims, status.resourceClaimStatuses).
    resource_claims: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    @property
    def wants_gpu(self) -> bool:
        return any(c.wants_gpu for c in self.containers)

    def container(self, name: str) -> ContainerInfo | None:
        return next((c for c in self.containers if c.name == name), None)


def parse_time(text: str | None) -> float:
    """RFC 3339 as the API writes it (``2026-11-22T10:00:00Z``) → epoch seconds; 0 if absent."""
    if not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError as err:
        raise PodFormatError(f"bad timestamp {text!r}") from err


def pod_from_json(obj: Mapping[str, Any]) -> PodInfo:
    """Parse one Pod object (as in a list or watch event); PodFormatError if unusable."""
    try:
        return _parse(obj)
    except (AttributeError, TypeError, KeyError, ValueError) as err:  # a field of the wrong JSON type
        raise PodFormatError(f"malformed pod object: {type(err).__name__}: {err}") from err


def _parse(obj: Mapping[str, Any]) -> PodInfo:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if not isinstance(uid, str) or not uid or not isinstance(name, str) or not name:
        raise PodFormatError(f"pod without metadata.uid or metadata.name: {dict(meta)!r:.200}")
    ids = _container_ids(status.get("initContainerStatuses"))
    ids.update(_container_ids(status.get("containerStatuses")))
    extended = _extended_claim(status.get("extendedResourceClaimStatus"))
    pod_sc = spec.get("securityContext")
    containers = [
        _container(c, i, True, ids, extended, pod_sc) for i, c in enumerate(spec.get("initContainers") or [])
    ]
    containers += [
        _container(c, i, False, ids, extended, pod_sc) for i, c in enumerate(spec.get("containers") or [])
    ]
    claims = _resource_claims(spec.get("resourceClaims"), status.get("resourceClaimStatuses"))
    if extended[1]:
        claims[EXTENDED_CLAIM] = extended[1]
    return PodInfo(
        uid=uid,
        namespace=str(meta.get("namespace") or "default"),
        name=name,
        node_name=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        resource_version=str(meta.get("resourceVersion") or ""),
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        containers=tuple(containers),
        qos_class=str(status.get("qosClass") or _qos_class(containers)),
        scheduler_name=str(spec.get("schedulerName") or "default-scheduler"),
        resource_claims=claims,
    )


def _resource_claims(declared: Any, statuses: Any) -> dict[str, str]:
    """Which ResourceClaim each pod claim resolves to: named directly, or made from a template
    (then only the status says which; absent until the claim exists)."""
    found = {
        str(c.get("name")): str(c["resourceClaimName"])
        for c in declared or []
        if c.get("name") and c.get("resourceClaimName")
    }
    for s in statuses or []:
        if s.get("name") and s.get("resourceClaimName"):
            found.setdefault(str(s["name"]), str(s["resourceClaimName"]))
    return found


def _container_ids(statuses: Any) -> dict[str, str]:
    return {str(s.get("name")): str(s.get("containerID") or "") for s in statuses or [] if s.get("name")}


def _extended_claim(raw: Any) -> tuple[frozenset[str], str]:
    """(containers, claim name) of the claim the scheduler made for extended resources that
    DRA serves (KEP-5004: status.extendedResourceClaimStatus)."""
    if not raw:
        return frozenset(), ""
    users = frozenset(
        str(m.get("containerName")) for m in raw.get("requestMappings") or [] if m.get("containerName")
    )
    return users, str(raw.get("resourceClaimName") or "")


def _container(  # noqa: PLR0917 (one call site per list of containers)
    raw: Mapping[str, Any],
    index: int,
    init: bool,
    ids: Mapping[str, str],
    extended: tuple[frozenset[str], str] = (frozenset(), ""),
    pod_security: Any = None,
) -> ContainerInfo:
    name = str(raw.get("name") or "")
    resources = raw.get("resources") or {}
    merged = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    runtime, _, container_id = ids.get(name, "").rpartition("://")
    return ContainerInfo(
        name=name,
        index=index,
        init=init,
        resources={str(k): str(v) for k, v in merged.items()},
        container_id=container_id,
        runtime=runtime,
        claims=tuple(str(c.get("name")) for c in resources.get("claims") or [] if c.get("name"))
        + ((EXTENDED_CLAIM,) if name in extended[0] and extended[1] else ()),
        root_risk=root_risk(pod_security, raw.get("securityContext")),
    )


def _qos_class(containers: list[ContainerInfo]) -> str:
    # Only used when status.qosClass is missing (a pod the API has not defaulted yet).
    if not any(("cpu" in c.resources or "memory" in c.resources) for c in containers):
        return "BestEffort"
    return "Burstable"
