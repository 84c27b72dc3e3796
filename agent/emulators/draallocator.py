"""The emulated kube-scheduler's DRA allocation (structured parameters, resource.k8s.io/v1) for
the subset vcuda uses, writing ``status.allocation`` of a ResourceClaim in the fake API server.

What it follows (k8s.io/dynamic-resource-allocation/structured, the 1.36 allocator):

- Pools: per (driver, pool name) only the slices of the highest ``spec.pool.generation``; a
  pool with fewer slices at that generation than ``resourceSliceCount`` is incomplete and not
  used. Node-local slices only (``spec.nodeName``). Pools by name, slices by name, devices in
  slice order: first fit.
- Requests: ``exactly`` with ``deviceClassName``, ``allocationMode`` ExactCount (``count``,
  default 1), ``capacity.requests`` and ``selectors``. One request never takes the same device
  twice; different requests and claims may share a device with ``allowMultipleAllocations``.
- Selectors of the class and of the request, in a CEL subset only (no CEL engine here):
  ``device.driver == '<name>'`` and ``device.attributes['<domain>'].<name> == <literal>``
  (string, int, true/false), joined by ``&&``. Anything else is refused with an error naming
  the expression. A missing attribute does not match (the real one reports a CEL error).
- Consumable capacity (KEP-5075): per capacity of the device, a request below
  ``validRange.min`` becomes min, one between steps rounds up to ``min + n*step``, one above
  ``max`` (or above every ``validValues``) makes the device ineligible; an absent request
  consumes ``requestPolicy.default`` (the whole value without a policy). The sum consumed on
  a device by every allocated claim plus this one never exceeds its value: over-consumption
  is refused here and never reaches a kubelet plugin. Results carry ``consumedCapacity`` (every
  capacity, zeros included) and a ``shareID`` (a UUID) on shareable devices; an unshareable
  device is exclusive.
- ``status.allocation``: ``devices.results``, ``devices.config`` (class configs first with the
  requests that used the class, source FromClass; then the claim's, FromClaim; a config that
  covers every request has no ``requests``), ``nodeSelector`` on the node's name
  (matchFields metadata.name), written through the status subresource with the claim's
  resourceVersion as precondition; ``reservedFor`` a pod when asked.

- Partitionable devices (KEP-4815): a pool's ``sharedCounters`` (counter sets in slices of
  their own) and each device's ``consumesCounters``. A device is eligible only while what the
  allocated claims (and this one) consume of each counter plus its own consumption stays
  within the set's value; a device many claims share consumes its counters once, at its first
  allocation. A device consuming a set the pool does not publish is never allocated.

Not modelled: general CEL; ``firstAvailable`` (prioritized lists), ``allocationMode: All``,
``adminAccess``, constraints (``matchAttribute``/``distinctAttribute``); counter consumption
in compatibility groups (KEP-5963), taints and tolerations, binding conditions, slices
with ``nodeSelector``/``allNodes``/``perDeviceNodeSelection``; backtracking across requests (the
real allocator tries other devices for an earlier request when a later one does not fit;
this one fails); scoring; fractional quantities; the scheduler's in-flight claims of other
pods; the ``resource.kubernetes.io/delete-protection`` finalizer.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.emulators.drapools import (
    Counters,
    Device,
    DraAllocationError,
    Key,
    add_counters,
    counter_usage,
    counters_refusal,
    published_counters,
    published_devices,
    quantity,
    selects,
    to_int,
    usage,
)

__all__ = ["DraAllocationError", "allocate_claim", "claim_name"]


def allocate_claim(
    claim: Mapping[str, Any],
    classes: Mapping[str, Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]],
    allocated: Iterable[Mapping[str, Any]],
    node: str | None = None,
) -> dict[str, Any]:
    """``status.allocation`` for ``claim`` on ``node`` (or the first node where it fits), given
    the DeviceClasses by name, all ResourceSlices and the other allocated claims."""
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for request in requests:
        _check_supported(request)
    slices, allocated = list(slices), list(allocated)
    devices = published_devices(slices)
    consumed, exclusive = usage(allocated)
    counters = _Counters(published_counters(slices), *counter_usage(allocated, devices))
    nodes = [node] if node else sorted({d.node for d in devices})
    why: list[str] = []
    for candidate in nodes:
        on_node = [d for d in devices if d.node == candidate]
        try:
            results = _fit(requests, classes, on_node, consumed, exclusive, counters=counters.copy())
        except _NoFit as err:
            why.append(f"node {candidate}: {err}")
            continue
        return _allocation(claim, classes, results, candidate)
    detail = "; ".join(why) or "no ResourceSlice publishes a device"
    raise DraAllocationError(f"cannot allocate claim {claim_name(claim)}: {detail}")


class _NoFit(DraAllocationError):
    """This node cannot satisfy a request (message: why), another node might."""


class _Counters:
    """The published counter sets, what is consumed of them, and by which devices."""

    def __init__(self, available: Counters, used: Counters, counted: set[Key]) -> None:
        self.available, self.used, self.counted = available, used, counted

    def copy(self) -> _Counters:
        return _Counters(self.available, {k: dict(v) for k, v in self.used.items()}, set(self.counted))

    def refusal(self, device: Device) -> str:
        if not device.consumes or device.key in self.counted:
            return ""
        return counters_refusal(device, self.used, self.available)

    def take(self, device: Device) -> None:
        if device.consumes and device.key not in self.counted:
            self.counted.add(device.key)
            add_counters(self.used, device)


def _fit(
    requests: Sequence[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
    devices: Sequence[Device],
    consumed: Mapping[Key, Mapping[str, int]],
    exclusive: set[Key],
    *,
    counters: _Counters,
) -> list[dict[str, Any]]:
    used = {key: dict(held) for key, held in consumed.items()}  # this claim's shares add up too
    taken = set(exclusive)
    results: list[dict[str, Any]] = []
    for request in requests:
        exactly, name = request["exactly"], str(request["name"])
        klass = classes.get(str(exactly.get("deviceClassName")))
        if klass is None:
            raise DraAllocationError(
                f"request {name}: DeviceClass {exactly.get('deviceClassName')!r} not found"
            )
        selectors = [*((klass.get("spec") or {}).get("selectors") or []), *(exactly.get("selectors") or [])]
        wanted = {
            str(k): to_int(v, f"request {name}: capacity {k}")
            for k, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()
        }
        count, mine, refusals = int(exactly.get("count") or 1), set[Key](), []
        for device in devices:
            if len(mine) == count:
                break
            if device.key in taken or device.key in mine:  # one request never takes a device twice
                continue
            if not all(selects(str((s.get("cel") or {}).get("expression")), device) for s in selectors):
                continue
            amounts = _consumption(device, wanted, used.get(device.key, {}))
            if isinstance(amounts, str):
                refusals.append(f"{device.name}: {amounts}")
                continue
            over = counters.refusal(device)
            if over:
                refusals.append(f"{device.name}: {over}")
                continue
            counters.take(device)
            results.append(_result(name, device, amounts))
            if device.shared:
                held = used.setdefault(device.key, {})
                for capacity, amount in amounts.items():
                    held[capacity] = held.get(capacity, 0) + amount
            else:
                taken.add(device.key)
            mine.add(device.key)
        if len(mine) < count:
            detail = "; ".join(refusals) or "no free device matches the class and selectors"
            raise _NoFit(f"request {name} needs {count} device(s), found {len(mine)} ({detail})")
    return results


def _consumption(device: Device, wanted: Mapping[str, int], held: Mapping[str, int]) -> dict[str, int] | str:
    """Capacity consumed on ``device`` by a request, or why it cannot take it."""
    resolved: dict[str, int] = {}
    for name, amount in wanted.items():
        local = name.split("/", 1)[1] if name.startswith(f"{device.driver}/") else name
        if local not in device.capacity:
            return f"has no capacity {name!r}"
        resolved[local] = amount
    if not device.shared:  # requests only filter an exclusive device
        over = [n for n, a in resolved.items() if a > device.capacity[n].value]
        return f"{over[0]} {resolved[over[0]]} > {device.capacity[over[0]].value}" if over else {}
    amounts: dict[str, int] = {}
    for name, policy in device.capacity.items():
        consumed = policy.consume(resolved.get(name))
        if consumed is None:
            return f"{name} {quantity(resolved.get(name, 0), policy.binary)} is outside its request policy"
        if held.get(name, 0) + consumed > policy.value:
            used, asked, total = (
                quantity(x, policy.binary) for x in (held.get(name, 0), consumed, policy.value)
            )
            return f"{name}: {used} consumed + {asked} requested > {total}"
        amounts[name] = consumed
    return amounts


def _result(request: str, device: Device, amounts: Mapping[str, int]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": request,
        "driver": device.driver,
        "pool": device.pool,
        "device": device.name,
    }
    if device.shared:
        result["consumedCapacity"] = {
            name: quantity(amount, device.capacity[name].binary) for name, amount in amounts.items()
        }
        result["shareID"] = str(uuid.uuid4())
    return result


def _allocation(
    claim: Mapping[str, Any],
    classes: Mapping[str, Mapping[str, Any]],
    results: list[dict[str, Any]],
    node: str,
) -> dict[str, Any]:
    requests = claim["spec"]["devices"].get("requests") or []
    by_class: dict[str, list[str]] = {}
    for request in requests:
        by_class.setdefault(str(request["exactly"]["deviceClassName"]), []).append(str(request["name"]))
    config: list[dict[str, Any]] = []
    for class_name, names in by_class.items():
        for entry in (classes[class_name].get("spec") or {}).get("config") or []:
            config.append({"source": "FromClass", "requests": list(names), **_configuration(entry)})
    all_names = {str(r["name"]) for r in requests}
    for entry in claim["spec"]["devices"].get("config") or []:
        scope = list(entry.get("requests") or [])
        if not scope or all_names & set(scope):
            config.append({"source": "FromClaim", "requests": scope, **_configuration(entry)})
    for entry in config:  # a config for every request says so by naming none
        if not entry["requests"] or set(entry["requests"]) >= all_names:
            del entry["requests"]
    devices: dict[str, Any] = {"results": results}
    if config:
        devices["config"] = config
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {"devices": devices, "nodeSelector": {"nodeSelectorTerms": [term]}}


def _configuration(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {"opaque": copy.deepcopy(entry["opaque"])} if "opaque" in entry else {}


def _check_supported(request: Mapping[str, Any]) -> None:
    name = request.get("name")
    exactly = request.get("exactly")
    if not isinstance(exactly, Mapping):
        raise DraAllocationError(f"request {name}: only `exactly` requests are modelled (not firstAvailable)")
    mode = exactly.get("allocationMode") or "ExactCount"
    if mode != "ExactCount" or exactly.get("adminAccess"):
        raise DraAllocationError(f"request {name}: allocationMode {mode} / adminAccess is not modelled")


def claim_name(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"
