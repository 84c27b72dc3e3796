"""The node config (config.json of the ConfigMap, read at start and re-read while running) and
the node inventory annotation (written by each agent, read by the scheduler extender).

Property: the parse returns a valid value or raises ConfigError / InventoryFormatError; when
exactly one field of a valid document was changed, the message names that field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from agent.control.configwatch import ConfigWatch
from agent.domain.nodeconfig import POLICIES, ClusterConfig, load_config, parse_config
from agent.domain.nodeinventory import (
    InventoryFormatError,
    NodeInventory,
    build_inventory,
    decode,
    encode,
)
from agent.errors import ConfigError
from agent.platform.gpu.inventory import Link, Topology, TopologyLevel
from tests.fuzz.strategies import (
    DEEP,
    Mutation,
    deep_json,
    dumps,
    json_bytes,
    json_values,
    mutations,
    raw_bytes,
    raw_text,
)
from tests.fuzz.tally import count
from tests.unit.kubefixtures import make_gpus

CONFIG: dict[str, Any] = {
    "nodeConfig": [
        {
            "name": "gpu-node-1",
            "deviceMemoryScaling": 0.9,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "cgroupDriver": "systemd",
            "sharingMode": "auto",
            "allowedPolicies": ["fixed-share", "burst-share"],
            "maxLimitRatio": 1.5,
        },
        {"name": "gpu-node-2.example.com"},
    ]
}
texts = st.one_of(raw_text, json_values.map(dumps), deep_json, mutations(CONFIG).map(lambda m: dumps(m.doc)))


def valid_config(config: ClusterConfig) -> None:
    for name, node in config.nodes.items():
        assert name == node.name and 0 < len(name) <= 253
        assert math.isfinite(node.device_memory_scaling) and 0 < node.device_memory_scaling <= 1
        assert node.allowed_policies and set(node.allowed_policies) <= set(POLICIES)
        assert 1 <= node.max_limit_ratio <= 100


def parse(text: str) -> ClusterConfig | ConfigError:
    count("nodeconfig")
    try:
        config = parse_config(text, "config.json")
    except ConfigError as err:
        assert err.problems and all(p.startswith("config.json") for p in err.problems)
        return err
    valid_config(config)
    return config


@given(text=texts)
@example(text=DEEP)  # json.loads: RecursionError
@example(text='{"nodeConfig": [{"name": "n", "deviceMemoryScaling": 1' + "0" * 400 + "}]}")  # isfinite(int)
def test_config_text(text: str) -> None:
    parse(text)


@given(mutation=mutations(CONFIG))
def test_config_names_the_field(mutation: Mutation) -> None:
    result = parse(dumps(mutation.doc))
    if isinstance(result, ConfigError) and mutation.path:
        message, path = str(result), mutation.path
        assert str(path[0]) in message
        if len(path) >= 2:
            assert f"nodeConfig[{path[1]}]" in message, message
        if len(path) >= 3:
            assert str(path[2]) in message or "listed twice" in message, message


@given(key=st.text(max_size=12).filter(lambda k: k not in CONFIG["nodeConfig"][0]), value=json_values)
def test_config_unknown_field_named(key: str, value: Any) -> None:
    doc = {"nodeConfig": [{**CONFIG["nodeConfig"][0], key: value}]}
    result = parse(dumps(doc))
    assert isinstance(result, ConfigError) and repr(key) in str(result)


def config_file(data: bytes) -> Path:
    handle = tempfile.NamedTemporaryFile(prefix="vcuda-fuzz-", suffix=".json", delete=False)  # noqa: SIM115
    with handle:
        handle.write(data)
    return Path(handle.name)


@given(data=raw_bytes | json_bytes | mutations(CONFIG).map(lambda m: dumps(m.doc).encode()))
@example(data=b'{"nodeConfig": []}\xff')  # not UTF-8: UnicodeDecodeError
def test_config_file_at_start_and_reload(data: bytes) -> None:
    count("nodeconfig.file")
    path = config_file(dumps(CONFIG).encode())
    try:
        watch = ConfigWatch(path, "gpu-node-1", load_config(path), period_s=3600)
        path.write_bytes(data)
        try:
            valid_config(load_config(path))  # at start: a config or ConfigError
        except ConfigError as err:
            assert str(path) in str(err)
        taken = watch.reload()  # while running: a bad file is refused, the old config kept
        assert taken or watch.node.device_memory_scaling == 0.9
    finally:
        path.unlink()


# -- the inventory annotation --------------------------------------------------------------------

GPUS = make_gpus(3)
GPUS[2] = dataclasses.replace(GPUS[2], numa_node=None)  # "numa": null is valid too
INVENTORY = build_inventory(
    "gpu-node-1",
    GPUS,
    Topology({(0, 1): Link(TopologyLevel.SINGLE_SWITCH, 18), (1, 2): Link(TopologyLevel.NODE)}),
    healthy={1: False},
    scaling=0.9,
    heartbeat=1_800_000_000.0,
)
ANNOTATION = encode(INVENTORY)
INVENTORY_DOC = json.loads(ANNOTATION)


def valid_inventory(inventory: NodeInventory) -> None:
    assert isinstance(inventory.node, str) and isinstance(inventory.memory_scaling, float)
    assert isinstance(inventory.heartbeat, float)
    for gpu in inventory.gpus:
        assert all(
            isinstance(v, int) and v >= 0 for v in (gpu.index, gpu.memory_mib, gpu.schedulable_mib, gpu.cores)
        )
        assert gpu.numa is None or isinstance(gpu.numa, int)
        assert isinstance(gpu.healthy, bool) and isinstance(gpu.uuid, str) and isinstance(gpu.model, str)
        for peer, link in gpu.links.items():
            assert isinstance(peer, int) and peer >= 0
            assert (
                isinstance(link.level, TopologyLevel) and isinstance(link.nvlinks, int) and link.nvlinks >= 0
            )


def read(text: str) -> NodeInventory | InventoryFormatError:
    count("nodeinventory")
    try:
        inventory = decode(text)
    except InventoryFormatError as err:
        assert "nvidia.com/vcuda-inventory" in str(err)
        return err
    valid_inventory(inventory)
    return inventory


def expected_name(path: tuple[str | int, ...]) -> str:
    """How the message names the changed part: ``gpus[1].links`` for a GPU's field."""
    if path[0] == "gpus" and len(path) >= 3:
        return f"gpus[{path[1]}].{path[2]}"
    if path[0] == "gpus" and len(path) == 2:
        return f"gpus[{path[1]}]"
    return "heartbeat" if path[0] == "heartbeat" else str(path[0])


@given(text=st.one_of(raw_text, json_values.map(dumps), deep_json))
@example(text=DEEP)  # json.loads: RecursionError
def test_inventory_text(text: str) -> None:
    read(text)


@given(mutation=mutations(INVENTORY_DOC))
@example(mutation=Mutation({**INVENTORY_DOC, "memoryScaling": 10**400}, ("memoryScaling",), False))  # float()
def test_inventory_names_the_field(mutation: Mutation) -> None:
    result = read(dumps(mutation.doc))
    if isinstance(result, InventoryFormatError) and mutation.path:
        assert expected_name(mutation.path) in str(result), (mutation.path, str(result))


def test_the_valid_documents_parse() -> None:
    # The mutations start from documents that parse, so a refusal is the mutation's doing.
    assert isinstance(parse(dumps(CONFIG)), ClusterConfig)
    assert read(ANNOTATION) == INVENTORY
