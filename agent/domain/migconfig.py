"""The ``mig`` section of a node's config: how MIG devices are offered (the strategy) and,
optionally, the geometry each GPU should have::

    "mig": {"strategy": "mixed",                         # none (default), single or mixed
            "geometry": {"0": ["3g.40gb", "2g.20gb", "1g.10gb"], "1": []},
            "dynamic": [2, 3]}                              # GPUs on dynamic MIG through DRA

``strategy``, as NVIDIA's device plugin names them: ``none`` advertises no MIG device;
``mixed`` one resource per profile (``nvidia.com/mig-3g.40gb``); ``single`` every MIG
device as ``nvidia.com/gpu``, which needs them all of one profile. ``geometry``: per GPU
index, the GPU instances (each with one compute instance over all of its slices) the
agent creates when the GPU has no processes, enabling MIG mode first if needed; ``[]`` is
MIG mode with no instance. A GPU not listed is left as it is. ``dynamic``: the GPU indexes
whose MIG instances the DRA driver creates and destroys per claim (docs/dra.md, "Dynamic MIG
through DRA"), whatever the strategy; a GPU cannot have both a geometry and dynamic MIG.

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
_FIELDS = ("strategy", "geometry", "onDemand", "dynamic")


@dataclass(frozen=True)
class MigConfig:
    """A node's ``mig`` section; the default offers no MIG device and changes no GPU."""

    strategy: MigStrategy = MigStrategy.NONE
    geometry: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # GPU index -> profile names
    dynamic: frozenset[int] = frozenset()  # GPU indexes on dynamic MIG through DRA
    on_demand: frozenset[int] = frozenset()  # GPUs serving hardware-isolated shares (parse_on_demand)


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
    on_demand = parse_on_demand(raw.get("onDemand", []), geometry, f"{where}: mig.onDemand", problems)
    dynamic = _dynamic(raw.get("dynamic", []), geometry, on_demand, f"{where}: mig.dynamic", problems)
    if len(problems) > before:
        return MigConfig()
    return MigConfig(MigStrategy(strategy), geometry, dynamic=dynamic, on_demand=on_demand)


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


# Hardware-isolated shares on demand ---------------------------------------------------------
# ``"onDemand": [0]``: GPU 0 is kept in MIG mode and serves vcuda-core/vcuda-memory shares of
# pods annotated ``nvidia.com/vcuda-isolation: mig`` only, each from a MIG instance made for it
# at Allocate (control/migshares.py). A GPU cannot be both on demand and in the geometry.


def parse_on_demand(
    raw: Any, geometry: Mapping[int, tuple[str, ...]], where: str, problems: list[str]
) -> frozenset[int]:
    """The ``onDemand`` list of GPU indexes; problems appended to ``problems``."""
    if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        problems.append(f"{where} must be a list of GPU indexes, e.g. [0, 1]")
        return frozenset()
    bad = [i for i in raw if not 0 <= i <= MAX_GPU_INDEX]
    if bad:
        problems.append(f"{where}: {', '.join(map(str, bad))} is not a GPU index (0..{MAX_GPU_INDEX})")
    both = sorted(set(raw) & set(geometry))
    if both:
        problems.append(
            f"{where}: GPU {', '.join(map(str, both))} also has a mig.geometry: a GPU serves either "
            "the geometry's static MIG devices or isolated shares on demand, not both"
        )
    return frozenset(i for i in raw if 0 <= i <= MAX_GPU_INDEX)


# Dynamic MIG through DRA ----------------------------------------------------------------------
# ``"dynamic": [1]``: the DRA driver publishes GPU 1's MIG placements as partitionable devices
# and creates and destroys its instances per claim (control/dramig.py, docs/dra.md).


def _dynamic(
    raw: Any,
    geometry: Mapping[int, tuple[str, ...]],
    on_demand: frozenset[int],
    where: str,
    problems: list[str],
) -> frozenset[int]:
    """The ``dynamic`` list of GPU indexes; problems appended to ``problems``."""
    ok = isinstance(raw, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_GPU_INDEX for i in raw
    )
    if not ok:
        problems.append(
            f"{where} must be a list of GPU indexes (0..{MAX_GPU_INDEX}), e.g. [0, 1], got {raw!r}"
        )
        return frozenset()
    for other, name in ((set(geometry), "mig.geometry"), (on_demand, "mig.onDemand")):
        both = sorted(set(raw) & other)
        if both:
            problems.append(
                f"{where}: GPU {', '.join(map(str, both))} is also in {name}: a GPU's MIG instances "
                "belong to one owner"
            )
    return frozenset(raw)
