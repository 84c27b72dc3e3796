"""The node inventory annotation (versioned JSON), vcuda-memory capacity and GFD labels."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from agent.domain.nodeinventory import (
    COUNT_LABEL,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
    InventoryFormatError,
    build_inventory,
    decode,
    encode,
    gpu_labels,
    label_value,
    memory_capacity_mib,
    schedulable_mib,
)
from agent.platform.gpu.inventory import GpuInfo, Link, TopologyLevel
from agent.platform.gpu.sim.inventory import sim_numa_nodes, sim_topology
from agent.platform.gpu.sim.spec import parse_simulate_spec

HEARTBEAT = 1_735_787_045.0  # 2025-01-02T03:04:05Z
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def sim_gpus(spec: str) -> list[GpuInfo]:
    models = parse_simulate_spec(spec)
    numa = sim_numa_nodes(len(models))
    return [
        GpuInfo(
            i, f"GPU-{i:08d}-0000-0000-0000-000000000000", m.product_name, m.memory_mib, i, f"0:{i}", numa[i]
        )
        for i, m in enumerate(models)
    ]


def test_schedulable_memory_is_floored_and_exact() -> None:
    assert schedulable_mib(81559, 0.9) == 73403  # 73403.1
    assert schedulable_mib(100, 0.29) == 29  # 28.999999999999996 in floating point
    assert schedulable_mib(81920, 1.0) == 81920
    gpus = sim_gpus("4xH100-80GB")
    assert memory_capacity_mib(gpus, {}, 0.5) == 4 * 40960
    assert memory_capacity_mib(gpus, {1: False, 2: True}, 0.5) == 3 * 40960
    assert memory_capacity_mib(gpus, dict.fromkeys(range(4), False), 1.0) == 0


def test_encode_matches_the_documented_format() -> None:
    models = parse_simulate_spec("4xH100-80GB")
    gpus = sim_gpus("4xH100-80GB")
    inventory = build_inventory(
        "gpu-node-1", gpus, sim_topology(models), healthy={2: False}, scaling=0.9, heartbeat=HEARTBEAT
    )
    text = encode(inventory)
    assert " " not in text.replace("NVIDIA H100 80GB HBM3", "")  # compact
    raw = json.loads(text)
    assert list(raw) == ["version", "heartbeat", "node", "memoryScaling", "gpus"]
    assert raw["version"] == 1
    assert raw["heartbeat"] == "2025-01-02T03:04:05Z"
    assert raw["node"] == "gpu-node-1"
    assert raw["memoryScaling"] == 0.9
    assert raw["gpus"][0] == {
        "index": 0,
        "uuid": gpus[0].uuid,
        "model": "NVIDIA H100 80GB HBM3",
        "memoryMiB": 81920,
        "schedulableMiB": 73728,
        "cores": 100,
        "numa": 0,
        "healthy": True,
        # The simulated 4-GPU node: 0-1 share a switch and 18 NVLinks; 0-1 vs 2-3 are on
        # different NUMA nodes.
        "links": {"1": "SINGLE_SWITCH", "2": "SYSTEM", "3": "SYSTEM"},
        "nvlinks": {"1": 18},
    }
    assert [g["healthy"] for g in raw["gpus"]] == [True, True, False, True]
    assert [g["numa"] for g in raw["gpus"]] == [0, 0, 1, 1]
    assert inventory.capacity_mib == 3 * 73728
    assert encode(inventory) == text  # deterministic: equal content, equal text


def test_decode_round_trips() -> None:
    models = parse_simulate_spec("2xA100-40GB,2xT4-16GB")
    gpus = [*sim_gpus("2xA100-40GB,2xT4-16GB")]
    gpus[3] = GpuInfo(3, gpus[3].uuid, gpus[3].model, gpus[3].memory_mib, 3, "0:3", None)
    inventory = build_inventory(
        "n", gpus, sim_topology(models), healthy={0: False}, scaling=0.75, heartbeat=HEARTBEAT
    )
    decoded = decode(encode(inventory))
    assert decoded == inventory
    assert decoded.gpus[0].links[1] == Link(TopologyLevel.SINGLE_SWITCH, 12)
    assert decoded.gpus[3].numa is None
    assert decoded.age_s(HEARTBEAT + 12.5) == 12.5


def test_decode_ignores_fields_added_within_version_1() -> None:
    raw = json.loads(
        encode(
            build_inventory(
                "n", sim_gpus("1xL4-24GB"), sim_topology([]), healthy={}, scaling=1.0, heartbeat=HEARTBEAT
            )
        )
    )
    raw["future"] = {"x": 1}
    raw["gpus"][0]["migProfiles"] = []
    raw["gpus"][0].pop("nvlinks")  # optional: no NVLinks
    inventory = decode(json.dumps(raw))
    assert inventory.gpus[0].model == "NVIDIA L4" and inventory.gpus[0].links == {}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda raw: raw.update(version=2), "version 2; this reader understands version 1 only"),
        (lambda raw: raw.update(version=True), "version True"),
        (lambda raw: raw.pop("version"), "version None"),
        (lambda raw: raw.update(heartbeat="yesterday"), "heartbeat 'yesterday' is not an RFC 3339 time"),
        (lambda raw: raw.update(heartbeat="2025-01-02T03:04:05"), "has no time zone"),
        (lambda raw: raw.update(gpus={}), "gpus must be a list, got an object"),
        (lambda raw: raw.pop("node"), "node must be a string, got nothing"),
        (lambda raw: raw.update(memoryScaling="0.9"), "memoryScaling must be a number"),
        (lambda raw: raw["gpus"][0].update(memoryMiB=-1), "gpus[0].memoryMiB must not be negative"),
        (
            lambda raw: raw["gpus"][0].update(memoryMiB=1.5),
            "gpus[0].memoryMiB must be an integer, got a number",
        ),
        (
            lambda raw: raw["gpus"][0].update(healthy="yes"),
            "gpus[0].healthy must be true or false, got a string",
        ),
        (lambda raw: raw["gpus"][0].update(numa="0"), "gpus[0].numa must be an integer or null"),
        (lambda raw: raw["gpus"][0]["links"].update({"1": "NVLINK"}), "links['1'] = 'NVLINK'"),
        (lambda raw: raw["gpus"][0]["nvlinks"].update({"1": -2}), "nvlinks['1'] must be a count"),
        (lambda raw: raw["gpus"].append(7), "gpus[2] must be an object"),
    ],
)
def test_decode_refuses_bad_annotations(mutate: Callable[[dict[str, Any]], object], message: str) -> None:
    models = parse_simulate_spec("2xH100-80GB")
    raw = json.loads(
        encode(
            build_inventory(
                "n",
                sim_gpus("2xH100-80GB"),
                sim_topology(models),
                healthy={},
                scaling=1.0,
                heartbeat=HEARTBEAT,
            )
        )
    )
    mutate(raw)
    with pytest.raises(InventoryFormatError, match=re.escape(message)):
        decode(json.dumps(raw))


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '"text"'])
def test_decode_refuses_non_objects(text: str) -> None:
    with pytest.raises(InventoryFormatError, match=re.escape(INVENTORY_ANNOTATION)):
        decode(text)


def test_gfd_labels() -> None:
    assert gpu_labels(sim_gpus("2xH100-80GB,1xT4-16GB")) == {
        PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3",
        COUNT_LABEL: "3",
        MEMORY_LABEL: "81920",
    }
    assert gpu_labels([]) == {PRODUCT_LABEL: None, COUNT_LABEL: None, MEMORY_LABEL: None}


@pytest.mark.parametrize(
    ("model", "value"),
    [
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
        ("  NVIDIA GeForce RTX 4090 (rev a1)  ", "NVIDIA-GeForce-RTX-4090--rev-a1"),
        ("NVIDIA " + "X" * 80, "NVIDIA-" + "X" * 56),
        ("___", ""),
    ],
)
def test_label_values_are_valid(model: str, value: str) -> None:
    assert label_value(model) == value
    assert len(value) <= 63 and _LABEL_VALUE.match(value)
