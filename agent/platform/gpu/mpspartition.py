"""How MPS turns an active-thread percentage into streaming multiprocessors (SMs).

``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` limits the SMs a client's kernels may occupy. The
hardware cannot give a fraction of an SM, nor, on Volta and later, split a TPC (two SMs):
the limit is rounded down to whole TPCs (docs/reference.md, "How a GPU executes work": a
ceiling, rounded down to what the hardware can partition), and a client gets at least one
TPC. A 30 % client of a 132-SM H100 gets 38 SMs (28.8 %), not 39.6.

So the agent does not hand out the cap itself: it picks the most whole TPCs that stay
within the cap (a cap is a ceiling: at most one TPC below it, 1.5 pp on an H100; one TPC
at least) and writes the smallest whole percentage that rounds down to exactly that many,
so that the client's share does not hang on how the driver rounds a percentage. The SM
counts are the products' published figures; NVML reports them only for MIG devices, so the
table goes by product name. A GPU that is
not in the table is partitioned as if it had 100 SMs of one each (the percentage as given).

Where a lent GPU recorded how throughput follows the percentage (a share of SMs is not a
share of throughput: an H200 at 30 % ran a matmul loop at 24.8 % of its speed), the agent
calibrates by that curve instead: the highest percentage whose throughput stays within the
cap (so that a fixed share delivers [cap - 3, cap] where the hardware allows; the curve:
docs/reference.md, "Measured under MPS").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

SMS_PER_TPC = 2

# Throughput alone (% of the whole GPU) by active-thread percentage, as a lent GPU recorded
# it (bench/gpu_mps_probe.py --curve; docs/benchmarks.md): a 4096^2 fp32 matmul loop on an
# H200, driver 580. The driver's granularity is coarser than a TPC (29 and 30 % alike) and
# wave quantization makes it non-monotonic (61 % slower than 60 %). Between the recorded
# points it is interpolated linearly: a model, checked on hardware only at those points.
_THROUGHPUT_CURVES: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = (
    (
        "H200",
        (
            (10, 7.9), (20, 17.0), (25, 20.9), (29, 24.8), (30, 24.8), (31, 26.0), (40, 33.9),
            (50, 42.5), (60, 59.3), (61, 51.4), (75, 63.4), (90, 82.6), (100, 100.0),
        ),
    ),
)  # fmt: skip
Curve = tuple[tuple[float, float], ...]

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


def throughput_curve_for(product_name: str) -> Curve | None:
    """The recorded percentage-to-throughput curve of a product; None when none was recorded."""
    return next((curve for marker, curve in _THROUGHPUT_CURVES if marker in product_name), None)


def curve_throughput(percent: float, curve: Curve) -> float:
    """The fraction of the GPU's throughput a client at ``percent`` gets alone on ``curve``
    (linear between recorded points; from 0 below the first)."""
    points = ((0.0, 0.0), *curve)
    for (p0, t0), (p1, t1) in itertools.pairwise(points):
        if percent <= p1:
            return max(0.0, (t0 + (t1 - t0) * (percent - p0) / (p1 - p0)) / 100)
    return min(1.0, points[-1][1] / 100)


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


def partition_for(target_percent: int, sm_count: int | None, curve: Curve | None = None) -> Partition:
    """The percentage to write for ``target_percent`` of a GPU with ``sm_count`` SMs. With a
    recorded ``curve``: the highest whole percentage whose throughput stays within the
    target (a cap is a share of throughput, not of SMs: 30 -> 35 % on an H200, 29.5 %)."""
    target = min(100, max(1, target_percent))
    if curve is not None:
        percent = max(
            (p for p in range(1, 101) if curve_throughput(p, curve) <= target / 100 + 1e-9), default=1
        )
        sms = granted_sms(percent, sm_count) if sm_count else None
        return Partition(percent, sms, round(100 * curve_throughput(percent, curve), 2))
    if not sm_count:
        return Partition(target, None, float(target))
    tpcs = max(1, math.floor(target * sm_count / 100 / SMS_PER_TPC + 1e-9))
    sms = min(sm_count, tpcs * SMS_PER_TPC)
    percent = min(100, math.ceil(sms * 100 / sm_count - 1e-9))
    while percent > 1 and granted_sms(percent - 1, sm_count) >= sms:
        percent -= 1
    sms = granted_sms(percent, sm_count)
    return Partition(percent, sms, round(100 * sms / sm_count, 2))
