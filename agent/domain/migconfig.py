"""The ``mig`` section of a node's config: how MIG devices are offered (the strategy) and,
optionally, the geometry each GPU should have::

    "mig": {"strategy": "mixed",                         # none (default), single or mixed
            "geometry": {"0": ["3g.40gb", "2g.20gb", "1g.10gb"], "1": []}}

``strategy``, as NVIDIA's device plugin names them: ``none`` advertises no MIG device;
``mixed`` one resource per profile (``nvidia.com/mig-3g.40gb``); ``single`` every MIG
device as ``nvidia.com/gpu``, which needs them all of one profile. ``geometry``: per GPU
index, the GPU instances (each with one compute instance over all of its slices) the
agent creates when the GPU has no processes, enabling MIG mode first if needed; ``[]`` is
MIG mode with no instance. A GPU not listed is left as it is.

What can be checked without the GPU is checked here: the strategy, the shape, profile
names that no MIG product has, a geometry no product can take, and ``single`` with more
than one profile. Whether a geometry fits the GPU it names is checked against that GPU
before it is touched (``control/miggeometry.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.domain.miggeometry import fits_some_product, known_profile_names


class MigStrategy(enum.StrEnum):
    """How MIG devices are offered (the module docstring)."""

    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


MAX_GPU_INDEX = 63
_FIELDS = ("strategy", "geometry")


@dataclass(frozen=True)
class MigConfig:
    """A node's ``mig`` section; the default offers no MIG device and changes no GPU."""

    strategy: MigStrategy = MigStrategy.NONE
    geometry: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # GPU index -> profile names


def parse_mig(raw: Any, where: str, problems: list[str]) -> MigConfig:
    """The ``mig`` object of a node entry; each problem appended to ``problems`` (the result
    is then the default)."""
    before = len(problems)
    if not isinstance(raw, dict):
        problems.append(f"{where}: mig must be an object, got {type(raw).__name__}")
        return MigConfig()
    problems += [
        f"{where}: mig: unknown field {k!r} (known: {', '.join(_FIELDS)})" for k in raw if k not in _FIELDS
    ]
    strategy = raw.get("strategy", MigStrategy.NONE.value)
    strategies = [s.value for s in MigStrategy]
    if strategy not in strategies:
        problems.append(f"{where}: mig.strategy must be one of {', '.join(strategies)}, got {strategy!r}")
    geometry = _geometry(raw.get("geometry", {}), f"{where}: mig.geometry", problems)
    if strategy == MigStrategy.SINGLE.value:
        profiles = sorted({name for names in geometry.values() for name in names})
        if len(profiles) > 1:
            problems.append(
                f"{where}: mig.strategy single offers every MIG device as nvidia.com/gpu, so they must "
                f"all be of one profile; the geometry has {', '.join(profiles)} (use mixed)"
            )
    if len(problems) > before:
        return MigConfig()
    return MigConfig(MigStrategy(strategy), geometry)


def _geometry(raw: Any, where: str, problems: list[str]) -> dict[int, tuple[str, ...]]:
    if not isinstance(raw, dict):
        problems.append(
            f"{where} must be an object of GPU index -> list of profiles, got {type(raw).__name__}"
        )
        return {}
    known = known_profile_names()
    geometry: dict[int, tuple[str, ...]] = {}
    for key, names in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= MAX_GPU_INDEX):
            problems.append(f"{where}: {key!r} is not a GPU index (0..{MAX_GPU_INDEX})")
            continue
        at = f"{where}[{key!r}]"
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            problems.append(f'{at} must be a list of MIG profile names, e.g. ["3g.40gb", "1g.10gb"]')
            continue
        unknown = [n for n in names if n not in known]
        if unknown:
            problems.append(
                f"{at}: unknown MIG profile {', '.join(map(repr, unknown))} "
                f"(profiles: {', '.join(sorted(known))})"
            )
            continue
        why = fits_some_product(names) if names else None
        if why is not None:
            problems.append(f"{at}: the geometry does not fit any MIG GPU: {why}")
            continue
        geometry[int(key)] = tuple(names)
    return geometry
