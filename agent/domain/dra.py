"""Dynamic Resource Allocation (``resource.k8s.io/v1``): the names vcuda publishes and how an
allocated ResourceClaim reads as GPU shares.

One device per GPU, named ``gpu-<index>``, in a pool named after the node, with two consumable
capacities: ``cores`` (100 per GPU, like nvidia.com/vcuda-core) and ``memory`` (bytes, the
GPU's memory x deviceMemoryScaling, whole MiB). A claim's allocation result names the device
and, with consumable capacity (KEP-5075), what it consumed; the policy comes from the claim's
opaque config (``ShareConfig``) or, without one, the node's default policy.

A GPU on dynamic MIG (node config ``mig.dynamic``) also publishes one device per MIG profile
placement, named ``gpu-<index>-mig-<profile>-<start>`` (``3g.40gb`` at memory slice 4 is
``gpu-0-mig-3g40gb-4``: a device name is a DNS label, so the profile loses its dots), that a
claim takes whole (agent/domain/migpartition.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import VcudaError
from agent.platform.kube.pods import int_quantity

DRIVER = "gpu.vcuda.io"
CORES = "cores"
MEMORY = "memory"
CONFIG_API_VERSION = "gpu.vcuda.io/v1alpha1"
CONFIG_KIND = "ShareConfig"
CDI_KIND = "vcuda.io/gpu"  # CDI "vendor/class" of the specs the kubelet plugin writes
_DEVICE = re.compile(r"^gpu-(0|[1-9][0-9]{0,3})(?:-mig-([0-9]+g[0-9]+gb)-([0-7]))?$")
ISOLATION_MIG = "mig"  # ShareConfig.isolation: the share is served by a MIG instance of its own
MIB = 1 << 20


class ClaimError(VcudaError):
    """A ResourceClaim that cannot be prepared; the message names the field."""


def device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(index: int, profile: str, start: int) -> str:
    """The device of MIG profile ``profile`` (``3g.40gb``) at memory slice ``start`` of GPU
    ``index``: ``gpu-0-mig-3g40gb-4``."""
    return f"gpu-{index}-mig-{profile_token(profile)}-{start}"


def profile_token(profile: str) -> str:
    """A profile name as a DNS label part: ``3g.40gb`` -> ``3g40gb``."""
    return profile.replace(".", "")


def mig_slot(name: str) -> tuple[str, int] | None:
    """(profile token, start) of a MIG placement device name; None for a GPU device."""
    match = _DEVICE.match(name)
    if not match or match.group(2) is None:
        return None
    return match.group(2), int(match.group(3))


def device_index(name: str) -> int:
    """The GPU index of a device name; ClaimError if it is not one of ours."""
    match = _DEVICE.match(name)
    if not match:
        raise ClaimError(
            f"device {name!r} is not a vcuda GPU device (gpu-<index>, or gpu-<index>-mig-<profile>-<start>)"
        )
    return int(match.group(1))


@dataclass(frozen=True)
class ClaimShare:
    """One device allocated to a claim's request: which GPU and what the claim consumed."""

    request: str
    pool: str
    device: str
    gpu_index: int
    cores: int  # consumed cores; 100 for a whole device (no consumable capacity)
    memory_mib: int  # consumed memory; 0 when the claim consumed none (no quota)
    share_id: str  # the allocation's shareID ("" for a whole device)
    policy: str | None  # from the claim's ShareConfig; None: the node default
    limit: int | None  # ShareConfig.limit: a burst-share ceiling or a fixed-share cap
    isolation: str | None = None  # ShareConfig.isolation: "mig" demands a MIG instance of its own


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def main_request(name: str) -> str:
    """The main request of a request reference: ``gpu`` for ``gpu`` and for its subrequest
    ``gpu/small`` (a ``firstAvailable`` alternative; allocation results name the subrequest)."""
    return name.split("/", 1)[0]


def claim_shares(claim: Mapping[str, Any], node: str) -> list[ClaimShare]:
    """The shares of ``claim`` (a ResourceClaim object) on this node's pool, from
    status.allocation; ClaimError naming the field when it is not allocated or malformed."""
    allocation = _dict(_dict(claim.get("status"), "status").get("allocation"), "status.allocation")
    devices = _dict(allocation.get("devices"), "status.allocation.devices")
    results = devices.get("results")
    if not isinstance(results, list):
        raise ClaimError("status.allocation.devices.results is not a list")
    configs = _share_configs(devices.get("config"))
    shares = []
    for i, raw in enumerate(results):
        where = f"status.allocation.devices.results[{i}]"
        result = _dict(raw, where)
        if result.get("driver") != DRIVER:
            continue
        pool, device, request = (_text(result, key, where) for key in ("pool", "device", "request"))
        if pool != node:
            raise ClaimError(f"{where}.pool is {pool!r}, not this node's pool {node!r}")
        consumed = _dict(result.get("consumedCapacity") or {}, f"{where}.consumedCapacity")
        cores = _quantity(consumed, CORES, where, default=100)
        memory = _quantity(consumed, MEMORY, where, default=0)
        if not 1 <= cores <= 100:
            raise ClaimError(f"{where}.consumedCapacity.cores is {cores}: expected 1..100")
        policy, limit, isolation = _config_for(configs, request)
        shares.append(
            ClaimShare(
                request=request,
                pool=pool,
                device=device,
                gpu_index=device_index(device),
                cores=cores,
                memory_mib=-(-memory // MIB),
                share_id=str(result.get("shareID") or ""),
                policy=policy,
                limit=limit,
                isolation=isolation,
            )
        )
    return shares


_Config = tuple[str | None, int | None, str | None]  # (policy, limit, isolation)


def _config_for(configs: Mapping[str, _Config], request: str) -> _Config:
    """The config of an allocation result's request: one naming it exactly (``gpu/small``),
    else one naming its main request (``gpu``: "applies to all subrequests", API reference of
    DeviceClaimConfiguration.requests), else one for all requests, else none."""
    for key in (request, main_request(request), ""):
        if key in configs:
            return configs[key]
    return None, None, None


def _share_configs(raw: Any) -> dict[str, _Config]:
    """Request name ("" for all requests) -> (policy, limit, isolation) from our opaque configs."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise ClaimError("status.allocation.devices.config is not a list")
    found: dict[str, _Config] = {}
    for i, entry in enumerate(raw):
        where = f"status.allocation.devices.config[{i}]"
        opaque = _dict(entry, where).get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != DRIVER:
            continue
        params = _dict(opaque.get("parameters"), f"{where}.opaque.parameters")
        if params.get("apiVersion") != CONFIG_API_VERSION or params.get("kind") != CONFIG_KIND:
            raise ClaimError(f"{where}.opaque.parameters must be {CONFIG_API_VERSION} {CONFIG_KIND}")
        policy = params.get("policy")
        if policy is not None and policy not in ("fixed-share", "burst-share", "best-effort"):
            raise ClaimError(
                f"{where}.opaque.parameters.policy {policy!r}: fixed-share, burst-share or best-effort"
            )
        limit = params.get("limit")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100
        ):
            raise ClaimError(f"{where}.opaque.parameters.limit {limit!r}: an integer 1..100")
        isolation = params.get("isolation")
        if isolation not in (None, "none", ISOLATION_MIG):
            raise ClaimError(f"{where}.opaque.parameters.isolation {isolation!r}: mig or none")
        isolation = None if isolation == "none" else isolation
        requests = entry.get("requests") or [""]
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ClaimError(f"{where}.requests is not a list of names")
        for request in requests:
            found[request] = (policy, limit, isolation)
    return found


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ClaimError(f"{where} is missing or not an object")
    return value


def _text(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ClaimError(f"{where}.{key} is missing or not a string")
    return value


def _quantity(consumed: Mapping[str, Any], key: str, where: str, *, default: int) -> int:
    value = consumed.get(key)
    if value is None:
        return default
    try:
        return int_quantity(str(value))
    except ValueError as err:
        raise ClaimError(f"{where}.consumedCapacity.{key} {value!r}: {err}") from err


def claim_ref(claim: Mapping[str, Any]) -> ClaimRef:
    meta = _dict(claim.get("metadata"), "metadata")
    return ClaimRef(
        _text(meta, "namespace", "metadata"), _text(meta, "name", "metadata"), _text(meta, "uid", "metadata")
    )


def total_cores(shares: Sequence[ClaimShare]) -> int:
    return sum(s.cores for s in shares)


# The kubelet plugin's side ---------------------------------------------------------------
# kubelet lists these as PluginInfo.supported_versions; it takes the first it supports, so
# the newest goes first (kubelet 1.34+ speaks v1, 1.32-1.33 only v1beta1).
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources told kubelet."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedMig:
    """A MIG instance created for a claim's share (dynamic MIG): where it is and the device
    nodes its users need besides nvidiactl and UVM."""

    request: str
    device: str  # the allocated device (a placement device, or the GPU's share device)
    gpu_index: int
    gpu_minor: int  # the parent GPU's /dev/nvidia<minor>
    gi: int
    ci: int
    uuid: str  # MIG-...
    profile: str  # 3g.40gb
    start: int  # its placement on the GPU's memory slices
    size: int
    cap_minors: tuple[int, ...]  # /dev/nvidia-caps/nvidia-cap<minor> of its GI and CI


@dataclass(frozen=True)
class PreparedClaim:
    """A claim prepared on this node: its shares (one per allocated device) and the devices
    with CDI IDs kubelet was given; ``devices[i]`` is for ``shares[i]``. ``mig``: the MIG
    instances created for it (dynamic MIG), whose shares are not held by the ledger: the
    hardware holds them."""

    ref: ClaimRef
    shares: tuple[ClaimShare, ...]
    devices: tuple[PreparedDevice, ...]
    mig: tuple[PreparedMig, ...] = ()

    def mig_of(self, share: ClaimShare) -> PreparedMig | None:
        return next((m for m in self.mig if (m.request, m.device) == (share.request, share.device)), None)


def cdi_device_name(claim_uid: str, request: str, gpu_index: int, taken: Sequence[str] = ()) -> str:
    """``<claim UID>-<request>-gpu<index>``: unique across claims, readable in a runtime's error.
    A subrequest (``main/small``) becomes ``main.small``: CDI names allow no "/". The same
    request on the same GPU twice (two shares) gets ``-2``, ``-3`` ... after the first."""
    base = f"{claim_uid}-{request.replace('/', '.')}-gpu{gpu_index}"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def share_ceiling(share: ClaimShare, default_policy: str) -> int:
    """The most of its GPU a share may use, in percent (the MPS thread percentage): its cores
    for fixed-share (or ShareConfig.limit), the limit or the whole GPU for burst-share, the
    whole GPU for best-effort and for a whole device."""
    if share.cores >= 100:
        return 100
    policy = share.policy or default_policy
    if policy == "best-effort":
        return 100
    if policy == "burst-share":
        return share.limit or 100
    return share.limit or share.cores
