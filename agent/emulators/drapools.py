"""What the emulated DRA allocator reads from the API: the devices of complete pools at their
highest generation (ResourceSlices), what allocated claims already hold, capacity request
policies, and the CEL subset of selectors it evaluates. See agent/emulators/draallocator.py
for the rules it follows and what it does not model."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.errors import AllocationError
from agent.platform.kube.pods import int_quantity

_DRIVER_EQ = re.compile(r"^device\.driver\s*==\s*(['\"])([^'\"]*)\1$")
_ATTR_EQ = re.compile(
    r"^device\.attributes\[(['\"])([^'\"]+)\1\]\.([A-Za-z][A-Za-z0-9_]*)\s*==\s*"
    r"(?:(['\"])(?P<text>[^'\"]*)\4|(?P<int>-?[0-9]+)|(?P<bool>true|false))$"
)
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))

Key = tuple[str, str, str]  # (driver, pool, device)
CounterKey = tuple[str, str, str]  # (driver, pool, counter set)
Counters = dict[CounterKey, dict[str, int]]  # counter set -> counter -> amount


class DraAllocationError(AllocationError):
    """A claim the emulated allocator cannot allocate; the message says why."""


def to_int(value: Any, where: str) -> int:
    """An integer quantity (``30``, ``4Gi``); DraAllocationError for anything else, fractions
    included (not modelled)."""
    try:
        return int_quantity(str(value))
    except ValueError as err:
        raise DraAllocationError(f"{where}: {err} (only integer quantities are modelled)") from err


@dataclass(frozen=True)
class Policy:
    """One device capacity and its request policy, in integer units."""

    value: int
    default: int | None = None
    minimum: int | None = None  # validRange
    maximum: int | None = None
    step: int | None = None
    valid_values: tuple[int, ...] = ()
    binary: bool = False  # quantities print with binary suffixes (bytes)

    def consume(self, requested: int | None) -> int | None:
        """What a request consumes (None: the policy refuses it)."""
        if requested is None:
            amount = self.value if self.default is None else self.default
        elif self.minimum is not None:
            amount = max(requested, self.minimum)
            if self.step:
                amount = self.minimum + -(-(amount - self.minimum) // self.step) * self.step
        elif self.valid_values:
            amount = next((v for v in self.valid_values if v >= requested), requested)
        else:
            amount = requested
        if self.default is not None and amount == self.default:
            return amount
        if self.minimum is not None:
            if self.maximum is not None and amount > self.maximum:
                return None
            if self.step and (amount - self.minimum) % self.step:
                return None
        elif self.valid_values and amount not in self.valid_values:
            return None
        return amount


@dataclass(frozen=True)
class Device:
    driver: str
    pool: str
    node: str
    name: str
    attributes: Mapping[str, Any]
    capacity: Mapping[str, Policy]
    shared: bool  # allowMultipleAllocations
    consumes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # counter set -> counters

    @property
    def key(self) -> Key:
        return (self.driver, self.pool, self.name)


def published_devices(slices: Iterable[Mapping[str, Any]]) -> list[Device]:
    """The usable devices of complete pools at their highest generation, in allocation order."""
    devices = []
    for driver, pool, current in _current_pools(slices):
        for obj in current:
            for raw in obj["spec"].get("devices") or []:
                capacity = {str(k): capacity_policy(v) for k, v in (raw.get("capacity") or {}).items()}
                devices.append(
                    Device(
                        driver,
                        pool,
                        str(obj["spec"]["nodeName"]),
                        str(raw["name"]),
                        dict(raw.get("attributes") or {}),
                        capacity,
                        bool(raw.get("allowMultipleAllocations")),
                        _consumes(raw.get("consumesCounters") or [], str(raw["name"])),
                    )
                )
    return devices


def published_counters(slices: Iterable[Mapping[str, Any]]) -> Counters:
    """The shared counter sets of complete pools at their highest generation."""
    found: Counters = {}
    for driver, pool, current in _current_pools(slices):
        for obj in current:
            for raw in obj["spec"].get("sharedCounters") or []:
                counters = raw.get("counters") or {}
                found[(driver, pool, str(raw["name"]))] = {
                    str(k): to_int((v or {}).get("value"), f"counter {k} of set {raw['name']}")
                    for k, v in counters.items()
                }
    return found


def _consumes(raw: Iterable[Mapping[str, Any]], device: str) -> dict[str, dict[str, int]]:
    consumes: dict[str, dict[str, int]] = {}
    for entry in raw:
        held = consumes.setdefault(str(entry["counterSet"]), {})
        for name, value in (entry.get("counters") or {}).items():
            held[str(name)] = held.get(str(name), 0) + to_int(
                (value or {}).get("value"), f"counter {name} consumed by {device}"
            )
    return consumes


def counter_usage(
    claims: Iterable[Mapping[str, Any]], devices: Iterable[Device]
) -> tuple[Counters, set[Key]]:
    """The counters allocated claims consume, and the devices that consumed them. A device that
    many claims share consumes its counters once, however many allocations it has."""
    by_key = {d.key: d for d in devices}
    used: Counters = {}
    counted: set[Key] = set()
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (str(result["driver"]), str(result["pool"]), str(result["device"]))
            device = by_key.get(key)
            if device is None or key in counted:
                continue
            counted.add(key)
            add_counters(used, device)
    return used, counted


def add_counters(used: Counters, device: Device) -> None:
    for counter_set, counters in device.consumes.items():
        held = used.setdefault((device.driver, device.pool, counter_set), {})
        for name, amount in counters.items():
            held[name] = held.get(name, 0) + amount


def counters_refusal(device: Device, used: Counters, available: Counters) -> str:
    """Why ``device``'s counters do not fit beside ``used`` ("": they do)."""
    for counter_set, counters in device.consumes.items():
        key = (device.driver, device.pool, counter_set)
        if key not in available:
            return f"consumes counter set {counter_set!r}, which the pool does not publish"
        for name, amount in counters.items():
            total = available[key].get(name)
            if total is None:
                return f"consumes counter {name!r}, which set {counter_set!r} does not have"
            held = used.get(key, {}).get(name, 0)
            if held + amount > total:
                return f"counter {counter_set}/{name}: {held} consumed + {amount} > {total}"
    return ""


def _current_pools(
    slices: Iterable[Mapping[str, Any]],
) -> list[tuple[str, str, list[Mapping[str, Any]]]]:
    """(driver, pool, its slices at the highest generation) of every complete node-local pool."""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("nodeName"):  # node-local only
            pools.setdefault((str(spec.get("driver")), str((spec.get("pool") or {}).get("name"))), []).append(
                obj
            )
    found = []
    for (driver, pool), members in sorted(pools.items()):
        top = max(_pool(m, "generation") for m in members)
        current = sorted(
            (m for m in members if _pool(m, "generation") == top), key=lambda m: str(m["metadata"]["name"])
        )
        if len(current) < max(_pool(current[0], "resourceSliceCount"), 1):
            continue  # incomplete: the driver is in the middle of an update
        found.append((driver, pool, current))
    return found


def _pool(obj: Mapping[str, Any], field: str) -> int:
    value = ((obj.get("spec") or {}).get("pool") or {}).get(field)
    return value if isinstance(value, int) else 0


def usage(claims: Iterable[Mapping[str, Any]]) -> tuple[dict[Key, dict[str, int]], set[Key]]:
    """What allocated claims hold: capacity consumed per shared device, and devices taken whole."""
    consumed: dict[Key, dict[str, int]] = {}
    exclusive: set[Key] = set()
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (str(result["driver"]), str(result["pool"]), str(result["device"]))
            if not result.get("shareID"):
                exclusive.add(key)
                continue
            held = consumed.setdefault(key, {})
            for name, text in (result.get("consumedCapacity") or {}).items():
                held[name] = held.get(name, 0) + to_int(text, f"consumedCapacity {name} of {key[2]}")
    return consumed, exclusive


def selects(expression: str, device: Device) -> bool:
    for clause in (c.strip() for c in expression.split("&&")):
        if match := _DRIVER_EQ.match(clause):
            if device.driver != match.group(2):
                return False
        elif match := _ATTR_EQ.match(clause):
            domain, attr = match.group(2), match.group(3)
            key = attr if domain == device.driver and attr in device.attributes else f"{domain}/{attr}"
            if _literal(match) != _attribute(device.attributes.get(key)):
                return False
        else:
            raise DraAllocationError(f"CEL selector {expression!r} is outside the modelled subset")
    return True


def _literal(match: re.Match[str]) -> Any:
    if match.group("bool") is not None:
        return match.group("bool") == "true"
    if match.group("int") is not None:
        return int(match.group("int"))
    return match.group("text")


def _attribute(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return _MISSING
    for kind in ("string", "int", "bool", "version"):
        if kind in value:
            return value[kind]
    return _MISSING


_MISSING = object()  # equal to no literal


def capacity_policy(raw: Mapping[str, Any]) -> Policy:
    text = str(raw["value"])
    policy = raw.get("requestPolicy") or {}
    valid_range = policy.get("validRange") or {}

    def number(value: Any) -> int | None:
        return None if value is None else to_int(value, "a capacity request policy")

    return Policy(
        value=to_int(text, "a capacity value"),
        default=number(policy.get("default")),
        minimum=number(valid_range.get("min")) if valid_range else None,
        maximum=number(valid_range.get("max")),
        step=number(valid_range.get("step")),
        valid_values=tuple(to_int(v, "validValues") for v in policy.get("validValues") or ()),
        binary=text.endswith("i"),
    )


def quantity(amount: int, binary: bool) -> str:
    """Canonical text of an integer quantity: ``4Gi``, ``1536Mi`` for bytes; ``30`` otherwise."""
    if binary and amount:
        for suffix, factor in _BINARY:
            if amount % factor == 0:
                return f"{amount // factor}{suffix}"
    return str(amount)
