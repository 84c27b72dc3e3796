"""``--simulate`` specs: COUNTxMODEL-MEMORYGB items separated by commas."""

from __future__ import annotations

import pytest

from agent.errors import InvalidSpecError
from agent.platform.gpu.inventory import TopologyLevel
from agent.platform.gpu.sim.inventory import sim_topology
from agent.platform.gpu.sim.spec import MAX_GPUS, SimGpuModel, parse_simulate_spec

EXAMPLE = "COUNTxMODEL-MEMORYGB"


def test_two_h100() -> None:
    models = parse_simulate_spec("2xH100-80GB")
    assert models == [SimGpuModel("H100", "NVIDIA H100 80GB HBM3", 81920, 18)] * 2
    link = sim_topology(models).link(0, 1)
    assert link.nvlinks == 18
    assert link.level is TopologyLevel.SINGLE_SWITCH


def test_mixed_models_in_index_order_without_nvlink() -> None:
    models = parse_simulate_spec("1xA100-40GB,1xT4-16GB")
    assert [(m.short_name, m.memory_mib) for m in models] == [("A100", 40960), ("T4", 16384)]
    assert models[0].product_name == "NVIDIA A100-SXM4-40GB"
    assert models[1].product_name == "Tesla T4"
    assert sim_topology(models).link(0, 1).nvlinks == 0  # different models: no NVLink bridge


@pytest.mark.parametrize(
    "spec",
    ["2xh100-80gb", "2Xh100-80Gb", " 2xH100-80GB ", "2 x H100-80GB", "1xH100-80GB, 1xH100-80GB"],
)
def test_case_and_spacing_are_forgiven(spec: str) -> None:
    assert parse_simulate_spec(spec) == parse_simulate_spec("2xH100-80GB")


def test_unknown_model_gets_a_generic_name() -> None:
    [model] = parse_simulate_spec("1xB200-192GB")
    assert model == SimGpuModel("B200", "NVIDIA B200-192GB", 192 * 1024, 0)


def test_maximum_gpu_count_is_accepted() -> None:
    assert len(parse_simulate_spec(f"{MAX_GPUS}xT4-16GB")) == MAX_GPUS == 64


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("", id="empty"),
        pytest.param("   ", id="blank"),
        pytest.param("2xH100", id="no-memory"),
        pytest.param("0xH100-80GB", id="zero-count"),
        pytest.param("2xH100-0GB", id="zero-memory"),
        pytest.param("2xH100-2048GB", id="too-much-memory"),
        pytest.param("H100-80GB", id="no-count"),
        pytest.param("2xH100-80GB,", id="trailing-comma"),
        pytest.param(",2xH100-80GB", id="leading-comma"),
        pytest.param("2xH100-80GB,,1xT4-16GB", id="empty-item"),
        pytest.param("2xH100-80MB", id="megabytes"),
        pytest.param("-2xH100-80GB", id="negative-count"),
        pytest.param("65xT4-16GB", id="too-many"),
        pytest.param("40xT4-16GB,25xA10-24GB", id="too-many-in-total"),
    ],
)
def test_invalid_specs_show_the_expected_format(spec: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_simulate_spec(spec)
    message = str(info.value)
    assert EXAMPLE in message
    assert "2xH100-80GB" in message


@pytest.mark.parametrize(
    ("spec", "detail"),
    [
        ("0xH100-80GB", "at least 1"),
        ("2xH100-0GB", "1..1024"),
        ("65xT4-16GB", "at most 64"),
    ],
)
def test_invalid_specs_say_what_is_wrong(spec: str, detail: str) -> None:
    with pytest.raises(InvalidSpecError, match=detail):
        parse_simulate_spec(spec)
