"""What one share was handed at Allocate, and grants.json, where the agent keeps them across
restarts (:mod:`.mpssharing`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent.domain.annotations import Policy
from agent.domain.specs import EnforcementSpec
from agent.errors import PlatformError
from agent.platform.atomicfile import read_text, write_atomic
from agent.platform.gpu.mpspartition import Partition
from agent.platform.mpsv3 import UNVERIFIED

# What parsing grants.json raises for any bytes in it (OverflowError: int(Infinity), float(10**400)).
_UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)


@dataclass(frozen=True)
class MpsGrant:
    """What one share was handed at Allocate."""

    gpu: int
    partition: Partition
    memory_mib: int | None  # pinned device-memory limit (None: none)
    pipe_dir: Path  # host path
    log_dir: Path
    advisory: bool = True  # the tenant can lift it (see the module docstring)
    namespace: str | None = None  # MPS v3: the daemon-side namespace that holds its limits

    def describe(self) -> str:
        sms = (
            f" = {self.partition.sms} SMs ({self.partition.effective_percent:g} %)"
            if self.partition.sms
            else ""
        )
        memory = f", {self.memory_mib} MiB pinned" if self.memory_mib else ""
        advisory = " (advisory: the tenant can lift it)" if self.advisory else ""
        if self.namespace is not None:
            advisory = f" (MPS v3 namespace {self.namespace} on the daemon's side; {UNVERIFIED})"
        return f"MPS {self.partition.percent} %{sms}{memory}{advisory}"


def load_grants(path: Path) -> tuple[dict[str, MpsGrant], str | None]:
    """The grants recorded in ``path``; why none could be read (None: read, or no file)."""
    try:
        text = read_text(path)
    except PlatformError as err:
        return {}, str(err)
    if text is None:
        return {}, None
    try:
        raw = json.loads(text)
        return {
            k: MpsGrant(
                int(v["gpu"]),
                Partition(int(v["percent"]), _int_or_none(v.get("sms")), float(v["effective_percent"])),
                _int_or_none(v.get("memory_mib")),
                Path(v["pipe_dir"]),
                Path(v["log_dir"]),
                v.get("advisory", True) is not False,
                _str_or_none(v.get("namespace")),
            )
            for k, v in raw.items()
        }, None
    except _UNREADABLE as err:
        return {}, str(err)


def save_grants(path: Path, grants: dict[str, MpsGrant]) -> str | None:
    """Record ``grants`` in ``path`` (atomically); why not (None: done)."""
    data = {
        k: {
            "gpu": g.gpu,
            "percent": g.partition.percent,
            "sms": g.partition.sms,
            "effective_percent": g.partition.effective_percent,
            "memory_mib": g.memory_mib,
            "pipe_dir": str(g.pipe_dir),
            "log_dir": str(g.log_dir),
            "advisory": g.advisory,
            "namespace": g.namespace,
        }
        for k, g in grants.items()
    }
    try:
        write_atomic(path, json.dumps(data).encode(), make_parents=True)
    except PlatformError as err:
        return str(err)
    return None


def _int_or_none(value: object) -> int | None:
    if value is None or type(value) is int:
        return value
    raise TypeError(f"{value!r} is not an integer or null")  # it would reach CUDA_MPS_* as is


def _str_or_none(value: object) -> str | None:
    if value is None or type(value) is str:
        return value
    raise TypeError(f"{value!r} is not a string or null")


def mps_ceiling(spec: EnforcementSpec, fixed_others: int) -> int:
    """The active-thread percentage a share's MPS limit is made from: its ceiling, and for
    best-effort and burst-share never into what the GPU's other fixed shares were promised
    (``fixed_others``: the sum of their caps)."""
    ceiling = spec.ceiling or 100
    if spec.policy is Policy.FIXED_SHARE:
        return ceiling
    return max(1, min(ceiling, 100 - fixed_others))
