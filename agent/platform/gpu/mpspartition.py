"""How MPS turns an active-thread percentage into streaming multiprocessors (SMs).

``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` limits the SMs a client's kernels may occupy. The
hardware cannot give a fraction of an SM, nor, on Volta and later, split a TPC (two SMs):
the limit is rounded down to whole TPCs (design notes §10: "a ceiling, rounded down to what
the hardware can partition"), and a client gets at least one TPC. A 30 % client of a
132-SM H100 gets 38 SMs (28.8 %), not 39.6.

So the agent does not hand out the cap itself: it picks the most whole TPCs that stay
within the cap (a cap is a ceiling: at most one TPC below it, 1.5 pp on an H100; one TPC
at least) and writes the smallest whole percentage that rounds down to exactly that many,
so that the client's share does not hang on how the driver rounds a percentage. The SM
counts are the products' published figures; NVML reports them only for MIG devices, so the
table goes by product name. A GPU that is
not in the table is partitioned as if it had 100 SMs of one each (the percentage as given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMS_PER_TPC = 2

# (substring of the NVML product name, SMs), most specific first.
_SM_COUNTS: tuple[tuple[str, int], ...] = (
    ("H100 PCIe", 114),
    ("H100 NVL", 132),
    ("H100", 132),
    ("H200", 132),
    ("H20", 78),
    ("B200", 148),
    ("A100", 108),
    ("A30", 56),
    ("A10", 72),
    ("L40S", 142),
    ("L40", 142),
    ("L4", 58),
    ("V100", 80),
    ("T4", 40),
)


def parse_percentage(text: str) -> float:
    """An active-thread percentage as MPS reads one: a number in (0, 100]; ValueError with
    the reason otherwise."""
    try:
        value = float(text)
    except ValueError as err:
        raise ValueError(f"{text!r} is not a number") from err
    if not 0 < value <= 100:
        raise ValueError(f"{text!r} is not in (0, 100]")
    return value


def sm_count_for(product_name: str) -> int | None:
    """The SM count of a product, from its NVML name; None when unknown."""
    for marker, count in _SM_COUNTS:
        if marker in product_name:
            return count
    return None


def granted_sms(percent: float, sm_count: int) -> int:
    """SMs a client gets for an active-thread percentage: rounded down to whole TPCs, at
    least one TPC, at most the GPU."""
    tpcs = math.floor(percent * sm_count / 100 / SMS_PER_TPC + 1e-9)
    return min(sm_count, max(SMS_PER_TPC, tpcs * SMS_PER_TPC))


def effective_share(percent: float, sm_count: int | None) -> float:
    """The fraction of the GPU (0..1] a client may use at ``percent``."""
    if not sm_count:
        return min(1.0, max(0.01, percent / 100))
    return granted_sms(percent, sm_count) / sm_count


@dataclass(frozen=True)
class Partition:
    """What the agent hands out for a target share of one GPU."""

    percent: int  # the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE value
    sms: int | None  # SMs the client gets (None: SM count unknown)
    effective_percent: float  # the share of the GPU those SMs are


def partition_for(target_percent: int, sm_count: int | None) -> Partition:
    """The percentage to write for ``target_percent`` of a GPU with ``sm_count`` SMs."""
    target = min(100, max(1, target_percent))
    if not sm_count:
        return Partition(target, None, float(target))
    tpcs = max(1, math.floor(target * sm_count / 100 / SMS_PER_TPC + 1e-9))
    sms = min(sm_count, tpcs * SMS_PER_TPC)
    percent = min(100, math.ceil(sms * 100 / sm_count - 1e-9))
    while percent > 1 and granted_sms(percent - 1, sm_count) >= sms:
        percent -= 1
    sms = granted_sms(percent, sm_count)
    return Partition(percent, sms, round(100 * sms / sm_count, 2))
