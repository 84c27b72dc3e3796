"""Parsing ``--simulate`` specs such as ``2xH100-80GB`` or ``1xA100-40GB,1xT4-16GB``.

Each model carries what NVML reports of it (product name, memory), its NVLinks in a pair,
and its per-process sample period. NVML documents the period as 1/6 s to 1 s depending on
the product without saying which product has which; every model here defaults to 1/6 s
(the shortest, most favourable to a controller), and ``vcuda-agent sim-gpu
--sample-period`` sets another for a run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import InvalidSpecError

_ITEM = re.compile(r"^(?P<count>\d+)\s*[xX]\s*(?P<model>[A-Za-z][A-Za-z0-9]*)-(?P<mem>\d+)GB$", re.IGNORECASE)
_EXAMPLE = (
    "expected COUNTxMODEL-MEMORYGB items separated by commas, e.g. 2xH100-80GB or 1xA100-40GB,1xT4-16GB"
)
MAX_GPUS = 64
DEFAULT_SAMPLE_PERIOD_S = 1 / 6

# Product names as NVML reports them, and NVLinks between the GPUs of a simulated pair.
_CATALOG: dict[str, tuple[str, int]] = {
    "H200": ("NVIDIA H200", 18),
    "H100": ("NVIDIA H100 {mem}GB HBM3", 18),
    "A100": ("NVIDIA A100-SXM4-{mem}GB", 12),
    "V100": ("Tesla V100-SXM2-{mem}GB", 6),
    "L40S": ("NVIDIA L40S", 0),
    "L4": ("NVIDIA L4", 0),
    "A10": ("NVIDIA A10", 0),
    "T4": ("Tesla T4", 0),
}


@dataclass(frozen=True)
class SimGpuModel:
    """One simulated GPU's model: short name, NVML-style product name, memory, NVLinks."""

    short_name: str
    product_name: str
    memory_mib: int
    pair_nvlinks: int
    sample_period_s: float = DEFAULT_SAMPLE_PERIOD_S


def parse_simulate_spec(spec: str) -> list[SimGpuModel]:
    """Expand a spec into one model per GPU, in index order."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise InvalidSpecError(f"invalid --simulate spec {spec!r}: {_EXAMPLE}")
    gpus: list[SimGpuModel] = []
    for item in items:
        match = _ITEM.match(item)
        if match is None:
            raise InvalidSpecError(f"invalid --simulate item {item!r} in {spec!r}: {_EXAMPLE}")
        count, model, mem_gb = int(match["count"]), match["model"].upper(), int(match["mem"])
        if count < 1:
            raise InvalidSpecError(f"invalid --simulate item {item!r}: count must be at least 1; {_EXAMPLE}")
        if not 1 <= mem_gb <= 1024:
            raise InvalidSpecError(f"invalid --simulate item {item!r}: memory must be 1..1024 GB; {_EXAMPLE}")
        name_template, nvlinks = _CATALOG.get(model, ("NVIDIA {model}-{mem}GB", 0))
        product = name_template.format(mem=mem_gb, model=model)
        gpus.extend(SimGpuModel(model, product, mem_gb * 1024, nvlinks) for _ in range(count))
    if len(gpus) > MAX_GPUS:
        raise InvalidSpecError(
            f"--simulate spec {spec!r} asks for {len(gpus)} GPUs; at most {MAX_GPUS}; {_EXAMPLE}"
        )
    return gpus
