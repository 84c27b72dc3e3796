"""The node config file: parsing, defaults and reporting of every invalid field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.domain.nodeconfig import ClusterConfig, NodeConfig, load_config, parse_config
from agent.errors import ConfigError

VALID = {
    "nodeConfig": [
        {
            "name": "gpu-node-1",
            "deviceMemoryScaling": 0.9,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "cgroupDriver": "systemd",
        },
        {"name": "gpu-node-2.example.com", "containerRuntimeEndpoint": "/run/crio/crio.sock"},
        {"name": "n3", "deviceMemoryScaling": 1, "cgroupDriver": "cgroupfs"},
    ]
}


def problems_of(raw: Any) -> list[str]:
    text = raw if isinstance(raw, str) else json.dumps(raw)
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.json")
    assert info.value.problems, "ConfigError without problems"
    assert str(info.value) == "; ".join(info.value.problems)
    return info.value.problems


def one_node(**fields: Any) -> dict[str, Any]:
    return {"nodeConfig": [{"name": "gpu-node-1", **fields}]}


def test_valid_config_is_parsed() -> None:
    config = parse_config(json.dumps(VALID))
    assert set(config.nodes) == {"gpu-node-1", "gpu-node-2.example.com", "n3"}
    assert config.for_node("gpu-node-1") == NodeConfig(
        "gpu-node-1", 0.9, "unix:///run/containerd/containerd.sock", "systemd"
    )
    assert config.for_node("gpu-node-2.example.com") == NodeConfig(
        "gpu-node-2.example.com", 1.0, "/run/crio/crio.sock", None
    )
    n3 = config.for_node("n3")
    assert n3 == NodeConfig("n3", 1.0, None, "cgroupfs")
    assert isinstance(n3.device_memory_scaling, float)


def test_unlisted_node_gets_defaults() -> None:
    config = parse_config(json.dumps(VALID))
    assert config.for_node("other-node") == NodeConfig(
        name="other-node",
        device_memory_scaling=1.0,
        container_runtime_endpoint=None,
        cgroup_driver=None,
    )


@pytest.mark.parametrize("text", ["{}", '{"nodeConfig": []}'])
def test_empty_config_gives_defaults(text: str) -> None:
    assert parse_config(text).for_node("x") == NodeConfig("x")
    assert ClusterConfig().for_node("x") == NodeConfig("x")


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        pytest.param({"deviceMemoryScaling": 0}, "deviceMemoryScaling", id="scaling-0"),
        pytest.param({"deviceMemoryScaling": 1.5}, "deviceMemoryScaling", id="scaling-1.5"),
        pytest.param({"deviceMemoryScaling": -1}, "deviceMemoryScaling", id="scaling-negative"),
        pytest.param({"deviceMemoryScaling": "0.5"}, "deviceMemoryScaling", id="scaling-string"),
        pytest.param({"deviceMemoryScaling": True}, "deviceMemoryScaling", id="scaling-bool"),
        pytest.param({"deviceMemoryScaling": None}, "deviceMemoryScaling", id="scaling-null"),
        pytest.param({"cgroupDriver": "docker"}, "cgroupDriver", id="cgroup-docker"),
        pytest.param({"cgroupDriver": 1}, "cgroupDriver", id="cgroup-number"),
        pytest.param({"sharingMode": "hami"}, "sharingMode", id="sharing-unknown"),
        pytest.param({"sharingMode": True}, "sharingMode", id="sharing-bool"),
        pytest.param({"mpsAdvisoryLimits": "yes"}, "mpsAdvisoryLimits", id="advisory-string"),
        pytest.param({"mpsAdvisoryLimits": 1}, "mpsAdvisoryLimits", id="advisory-int"),
        pytest.param({"allowedPolicies": []}, "allowedPolicies", id="policies-empty"),
        pytest.param({"allowedPolicies": ["yolo"]}, "allowedPolicies", id="policies-unknown"),
        pytest.param({"allowedPolicies": "best-effort"}, "allowedPolicies", id="policies-string"),
        pytest.param({"maxLimitRatio": 0.5}, "maxLimitRatio", id="ratio-below-1"),
        pytest.param({"maxLimitRatio": "2"}, "maxLimitRatio", id="ratio-string"),
        pytest.param(
            {"containerRuntimeEndpoint": "relative.sock"}, "containerRuntimeEndpoint", id="endpoint-relative"
        ),
        pytest.param({"containerRuntimeEndpoint": 5}, "containerRuntimeEndpoint", id="endpoint-number"),
        pytest.param(
            {"containerRuntimeEndpoint": "unix://"}, "containerRuntimeEndpoint", id="endpoint-empty"
        ),
        pytest.param({"containerRuntimeEndpoint": "/"}, "containerRuntimeEndpoint", id="endpoint-root"),
        pytest.param({"gpuCount": 2}, "gpuCount", id="unknown-field"),
    ],
)
def test_bad_field_names_node_and_field(fields: dict[str, Any], field_name: str) -> None:
    problems = problems_of(one_node(**fields))
    assert len(problems) == 1
    assert "gpu-node-1" in problems[0]
    assert field_name in problems[0]
    assert "cfg.json" in problems[0]


def test_nan_scaling_is_rejected() -> None:
    # Not JSON, but Python's json module accepts the NaN literal.
    problems = problems_of('{"nodeConfig": [{"name": "gpu-node-1", "deviceMemoryScaling": NaN}]}')
    assert len(problems) == 1
    assert "deviceMemoryScaling" in problems[0]


@pytest.mark.parametrize("entry", [{}, {"name": ""}, {"name": 7}, {"deviceMemoryScaling": 0.5}])
def test_missing_name(entry: dict[str, Any]) -> None:
    problems = problems_of({"nodeConfig": [{"name": "ok"}, entry]})
    assert len(problems) == 1
    assert "nodeConfig[1]" in problems[0]
    assert "name is required" in problems[0]


@pytest.mark.parametrize("name", ["GPU-Node-1", "node_1", "-node", "node-", "a" * 254, "node 1", "node-1\n"])
def test_invalid_node_name(name: str) -> None:
    problems = problems_of({"nodeConfig": [{"name": name}]})
    assert len(problems) == 1
    assert repr(name) in problems[0]
    assert "name is not a valid Kubernetes node name" in problems[0]


def test_duplicate_node() -> None:
    problems = problems_of({"nodeConfig": [{"name": "n1"}, {"name": "n2"}, {"name": "n1"}]})
    assert len(problems) == 1
    assert "nodeConfig[2]" in problems[0]
    assert "'n1'" in problems[0]
    assert "twice" in problems[0]


def test_unknown_top_level_field() -> None:
    problems = problems_of({"nodeConfig": [], "nodeConfigs": []})
    assert len(problems) == 1
    assert "'nodeConfigs'" in problems[0]


@pytest.mark.parametrize("value", [{}, "gpu-node-1", 3, None])
def test_node_config_not_a_list(value: Any) -> None:
    problems = problems_of({"nodeConfig": value})
    assert len(problems) == 1
    assert "nodeConfig must be a list" in problems[0]


@pytest.mark.parametrize("entry", ["gpu-node-1", 3, [], None])
def test_entry_not_an_object(entry: Any) -> None:
    problems = problems_of({"nodeConfig": [entry]})
    assert len(problems) == 1
    assert "nodeConfig[0]" in problems[0]
    assert "must be an object" in problems[0]


@pytest.mark.parametrize("text", ["", "{", "{'nodeConfig': []}", '{"nodeConfig": [}'])
def test_invalid_json(text: str) -> None:
    problems = problems_of(text)
    assert len(problems) == 1
    assert "not valid JSON" in problems[0]


@pytest.mark.parametrize("text", ["[]", '"x"', "3", "null"])
def test_top_level_not_an_object(text: str) -> None:
    problems = problems_of(text)
    assert len(problems) == 1
    assert "top level" in problems[0]


def test_every_problem_is_reported() -> None:
    raw = {
        "extra": 1,
        "nodeConfig": [
            {"name": "n1", "deviceMemoryScaling": 2, "cgroupDriver": "docker"},
            {"name": "Bad_Name"},
            "not-an-object",
            {"name": "n4", "containerRuntimeEndpoint": "relative.sock", "foo": 1},
        ],
    }
    problems = problems_of(raw)
    assert len(problems) >= 3
    text = "\n".join(problems)
    for expected in [
        "'extra'",
        "deviceMemoryScaling",
        "cgroupDriver",
        "'Bad_Name'",
        "nodeConfig[2]",
        "containerRuntimeEndpoint",
        "'foo'",
    ]:
        assert expected in text
    assert len(problems) == 7


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(VALID))
    assert load_config(path).for_node("n3").cgroup_driver == "cgroupfs"


def test_load_config_problems_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(one_node(cgroupDriver="docker")))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.problems[0]


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1
    assert str(path) in info.value.problems[0]
    assert "cannot read" in info.value.problems[0]


@pytest.mark.parametrize("mode", ["freezer", "mps", "auto"])
def test_sharing_mode_per_node(mode: str) -> None:
    config = parse_config(json.dumps(one_node(sharingMode=mode)))
    assert config.for_node("gpu-node-1").sharing_mode == mode
    assert config.for_node("other").sharing_mode is None  # the agent's --sharing-mode


@pytest.mark.parametrize("advisory", [True, False])
def test_mps_advisory_limits_per_node(advisory: bool) -> None:
    config = parse_config(json.dumps(one_node(mpsAdvisoryLimits=advisory)))
    assert config.for_node("gpu-node-1").mps_advisory_limits is advisory
    assert config.for_node("other").mps_advisory_limits is None  # the agent's --mps-advisory-limits


def test_policy_bounds_per_node_default_to_the_safe_set() -> None:
    config = parse_config(json.dumps(one_node(allowedPolicies=["fixed-share"], maxLimitRatio=2)))
    node = config.for_node("gpu-node-1")
    assert (node.allowed_policies, node.max_limit_ratio) == (("fixed-share",), 2.0)
    other = config.for_node("other")
    assert (other.allowed_policies, other.max_limit_ratio) == (("fixed-share", "burst-share"), 1.0)
