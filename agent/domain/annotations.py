"""Pod and node annotations the agent reads and writes (docs/reference.md, "Resources and
annotations"; README, "Annotations and labels").

Scheduler-extender annotations keep the gpu-admission names under ``nvidia.com/``:
``predicate-gpu-idx-<i>`` names the GPU index(es) chosen for app container ``i``
(its position in ``spec.containers``); init containers use
``predicate-gpu-idx-init-<i>``, which gpu-admission does not have.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

from agent.domain.ids import UNITS_PER_GPU

PREDICATE_IDX = "nvidia.com/predicate-gpu-idx-"
PREDICATE_IDX_INIT = "nvidia.com/predicate-gpu-idx-init-"
PREDICATE_TIME = "nvidia.com/predicate-time"
PREDICATE_NODE = "nvidia.com/predicate-node"
GPU_ASSIGNED = "nvidia.com/gpu-assigned"
CORE_LIMIT = "nvidia.com/vcuda-core-limit"
POLICY = "nvidia.com/vcuda-policy"  # pod annotation, and node label for the node default


class Policy(enum.StrEnum):
    """How a GPU share is enforced (qGPU's isolation policies)."""

    FIXED_SHARE = "fixed-share"  # never above the cap, even when the GPU idles
    BURST_SHARE = "burst-share"  # guaranteed the request, may borrow idle capacity up to the cap
    BEST_EFFORT = "best-effort"  # never throttled


DEFAULT_POLICY = Policy.FIXED_SHARE


# ASCII digits only, and few enough for int(): str.isdigit() also passes "²", which int() refuses.
_INDEX = re.compile(r"[0-9]{1,20}")
_SIGNED = re.compile(r"-?[0-9]{1,20}")


class AnnotationError(ValueError):
    """An annotation value the agent cannot use; the message says why and what is valid."""


def predicate_key(index: int, init: bool) -> str:
    return f"{PREDICATE_IDX_INIT if init else PREDICATE_IDX}{index}"


def parse_gpu_indexes(text: str) -> tuple[int, ...]:
    """``"0"`` or ``"0,1"`` → (0,) / (0, 1)."""
    items = [t.strip() for t in text.split(",")]
    if not items or not all(_INDEX.fullmatch(t) for t in items):
        raise AnnotationError(f"{text!r} is not a GPU index list like 0 or 0,1")
    return tuple(sorted({int(t) for t in items}))


def predicated_gpus(annotations: Mapping[str, str], index: int, init: bool) -> tuple[int, ...] | None:
    """The GPUs the extender chose for a container; None when it chose none (or garbage)."""
    text = annotations.get(predicate_key(index, init))
    if text is None:
        return None
    try:
        return parse_gpu_indexes(text)
    except AnnotationError:
        return None


def predicate_time(annotations: Mapping[str, str]) -> int | None:
    """UnixNano of the extender's bind, or None."""
    text = annotations.get(PREDICATE_TIME, "")
    return int(text) if _INDEX.fullmatch(text) else None


def is_assigned(annotations: Mapping[str, str]) -> bool:
    return annotations.get(GPU_ASSIGNED) == "true"


def parse_core_limit(text: str | None, request: int) -> tuple[int, str]:
    """``vcuda-core-limit``: percent of one GPU, from the request up to 100.

    Returns (cap, problem). Absent → the request. Invalid → the request (the safe
    default: a hard cap at what the pod asked for) and a problem message for an Event."""
    if text is None:
        return request, ""
    value = text.strip()
    rule = f"must be an integer from the request ({request}) to {UNITS_PER_GPU}"
    if not _SIGNED.fullmatch(value):
        return request, f"{CORE_LIMIT}={text!r} is not a number: it {rule}"
    limit = int(value)
    if limit < request or limit > UNITS_PER_GPU:
        return request, f"{CORE_LIMIT}={text!r} is out of range: it {rule}"
    return limit, ""


def parse_policy(text: str | None, default: Policy, where: str) -> tuple[Policy, str]:
    """(policy, problem); invalid → ``default`` and a problem message naming ``where``."""
    if text is None:
        return default, ""
    try:
        return Policy(text.strip()), ""
    except ValueError:
        valid = ", ".join(p.value for p in Policy)
        return default, f"{where} {POLICY}={text!r} is not a policy (valid: {valid})"


ISOLATION = "nvidia.com/vcuda-isolation"  # pod annotation: "mig" asks for a hardware-isolated share
ISOLATION_MIG = "mig"
_SHOWN_MAX = 64  # characters of a tenant's value quoted back in a message


def wants_isolation(annotations: Mapping[str, str]) -> bool:
    """Whether the pod asks for a hardware-isolated share; AnnotationError for any value but
    exactly ``mig`` (a tenant's annotation is hostile input: nothing is guessed from it)."""
    text = annotations.get(ISOLATION)
    if text is None:
        return False
    if text != ISOLATION_MIG:
        shown = text[:_SHOWN_MAX] + ("..." if len(text) > _SHOWN_MAX else "")
        raise AnnotationError(
            f"{ISOLATION}={shown!r} is not valid: the only value is {ISOLATION_MIG!r} (a MIG instance "
            "made for the share); leave the annotation out for a time-sliced share"
        )
    return True
