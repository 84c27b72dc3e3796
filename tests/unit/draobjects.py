"""ResourceClaim objects (``resource.k8s.io/v1`` JSON) as the API server returns them once
kube-scheduler allocated them, for the DRA kubelet plugin tests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.domain.dra import CONFIG_API_VERSION, CONFIG_KIND, DRIVER, ClaimRef
from agent.errors import KubeError
from agent.platform.driverfiles import DriverFiles, DriverMount
from agent.platform.gpu.inventory import GpuInfo

NODE = "gpu-node-1"
GPUS = tuple(
    GpuInfo(
        i, f"GPU-{i}{i}{i}{i}aaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "NVIDIA H100 80GB HBM3", 81920, minor, "", 0
    )
    for i, minor in enumerate([0, 3])
)
DRIVER_FILES = DriverFiles(
    libraries=(DriverMount("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/libcuda.so.550.54.15"),),
    binaries=(DriverMount("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),),
)


@dataclass(frozen=True)
class Result:
    """One allocated device of a claim: ``cores``/``memory`` None means no consumedCapacity
    (a whole device)."""

    request: str
    gpu: int
    cores: int | None = 30
    memory: str | None = "4Gi"
    pool: str = NODE
    driver: str = DRIVER


def claim_manifest(
    name: str, namespace: str = "default", requests: Sequence[str] = ("gpu",)
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": r,
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "capacity": {"requests": {"cores": "30", "memory": "4Gi"}},
                        },
                    }
                    for r in requests
                ]
            }
        },
    }


def allocation_status(results: Sequence[Result], policy: str | None = None) -> dict[str, Any]:
    out = []
    for r in results:
        entry: dict[str, Any] = {
            "request": r.request,
            "driver": r.driver,
            "pool": r.pool,
            "device": f"gpu-{r.gpu}",
        }
        if r.cores is not None:
            entry["shareID"] = str(uuid.uuid4())
            entry["consumedCapacity"] = {"cores": str(r.cores), **({"memory": r.memory} if r.memory else {})}
        out.append(entry)
    devices: dict[str, Any] = {"results": out}
    if policy is not None:
        devices["config"] = [
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "policy": policy},
                },
            }
        ]
    node_selector = {
        "nodeSelectorTerms": [
            {
                "matchFields": [
                    {
                        "key": "metadata.name",
                        "operator": "In",
                        "values": [results[0].pool if results else NODE],
                    }
                ]
            }
        ]
    }
    return {"allocation": {"devices": devices, "nodeSelector": node_selector}}


def allocated_claim(
    name: str,
    results: Sequence[Result] = (Result("gpu", 0),),
    *,
    namespace: str = "default",
    uid: str | None = None,
    policy: str | None = None,
) -> dict[str, Any]:
    claim = claim_manifest(name, namespace, sorted({r.request for r in results}) or ["gpu"])
    claim["metadata"]["uid"] = uid or str(uuid.uuid4())
    claim["metadata"]["resourceVersion"] = "1"
    claim["status"] = allocation_status(results, policy)
    return claim


def ref_of(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


class FakeClaims:
    """A ClaimReader over a dict, counting reads (a prepared claim is not read again)."""

    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        self.reads = 0

    def put(self, claim: dict[str, Any]) -> None:
        self.claims[(claim["metadata"]["namespace"], claim["metadata"]["name"])] = claim

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        claim = self.claims.get((namespace, name))
        if claim is None:
            raise KubeError(
                f"read ResourceClaim {namespace}/{name} failed (HTTP 404): "
                f'resourceclaims.resource.k8s.io "{name}" not found',
                status=404,
            )
        return claim
