"""The node config's MIG section (agent/domain/migconfig.py) and geometry plans
(agent/domain/miggeometry.py): the strategy, profile names, geometries that do not fit,
each refused with a message that says which node, which GPU and why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.domain.migconfig import MigConfig, MigStrategy
from agent.domain.miggeometry import fits_some_product, plan_geometry
from agent.domain.nodeconfig import parse_config
from agent.errors import ConfigError, MigGeometryError
from agent.platform.gpu.migprofiles import Placement, product, product_for


def node_with(mig: Any) -> str:
    return json.dumps({"nodeConfig": [{"name": "gpu-node-1", "mig": mig}]})


def problems(mig: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(node_with(mig), "cfg.json")
    return caught.value.problems


def test_a_mig_section_is_parsed() -> None:
    config = parse_config(
        node_with({"strategy": "mixed", "geometry": {"0": ["3g.40gb", "2g.20gb"], "1": []}})
    )
    assert config.for_node("gpu-node-1").mig == MigConfig(
        MigStrategy.MIXED, {0: ("3g.40gb", "2g.20gb"), 1: ()}
    )
    assert config.for_node("other").mig == MigConfig(MigStrategy.NONE, {})  # the default: none


def test_a_bad_strategy_says_which_are_known() -> None:
    (problem,) = problems({"strategy": "dynamic"})
    assert problem == (
        "cfg.json: nodeConfig[0] (node 'gpu-node-1'): mig.strategy must be one of none, single, mixed, "
        "got 'dynamic'"
    )


def test_an_unknown_profile_is_named() -> None:
    (problem,) = problems({"strategy": "mixed", "geometry": {"0": ["3g.40gb", "5g.50gb"]}})
    assert "mig.geometry['0']: unknown MIG profile '5g.50gb'" in problem
    assert "1g.10gb" in problem  # the profiles it could have been


def test_a_geometry_that_fits_no_gpu_says_why() -> None:
    (problem,) = problems({"geometry": {"0": ["4g.40gb", "4g.40gb"]}})
    assert "mig.geometry['0']: the geometry does not fit any MIG GPU" in problem
    assert "at most 1 4g.40gb on one GPU, 2 asked" in problem
    (mixed,) = problems({"geometry": {"0": ["1g.5gb", "1g.18gb"]}})
    assert "no MIG GPU has all of these profiles" in mixed


@pytest.mark.parametrize(
    ("mig", "expected"),
    [
        ("mixed", "mig must be an object, got str"),
        ({"strategy": "mixed", "layout": {}}, "mig: unknown field 'layout' (known: strategy, geometry"),
        ({"geometry": ["3g.40gb"]}, "mig.geometry must be an object of GPU index -> list of profiles"),
        ({"geometry": {"gpu0": ["3g.40gb"]}}, "mig.geometry: 'gpu0' is not a GPU index (0..63)"),
        ({"geometry": {"0": "3g.40gb"}}, "mig.geometry['0'] must be a list of MIG profile names"),
        (
            {"strategy": "single", "geometry": {"0": ["3g.40gb"], "1": ["2g.20gb"]}},
            "mig.strategy single offers every MIG device as nvidia.com/gpu, so they must all be of one "
            "profile; the geometry has 2g.20gb, 3g.40gb (use mixed)",
        ),
    ],
)
def test_shape_problems(mig: Any, expected: str) -> None:
    assert any(expected in p for p in problems(mig)), problems(mig)


def test_every_problem_of_the_section_is_reported() -> None:
    found = problems({"strategy": "x", "geometry": {"0": ["9g.9gb"], "1": ["7g.80gb", "1g.10gb"]}})
    assert len(found) == 3


def h100() -> Any:
    found = product("H100-80GB")
    assert found is not None
    return found


def test_a_plan_places_every_instance_explicitly() -> None:
    plan = plan_geometry(h100(), ["3g.40gb", "2g.20gb", "1g.10gb"])
    assert [(p.profile.name, p.placement, p.ci.name) for p in plan] == [
        ("3g.40gb", Placement(4, 4), "3g.40gb"),
        ("2g.20gb", Placement(0, 2), "2g.20gb"),
        ("1g.10gb", Placement(2, 1), "1g.10gb"),
    ]
    # The guide's order trap (1g, 1g, 2g, 3g) fits too: placements are chosen for all of them.
    plan = plan_geometry(h100(), ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"])
    assert sorted(str(p.placement) for p in plan) == ["0:2", "2:1", "3:1", "4:4"]


@pytest.mark.parametrize(
    ("names", "why"),
    [
        (["1g.10gb"] * 8, "at most 7 1g.10gb on one GPU, 8 asked"),
        (["4g.40gb", "3g.40gb", "1g.10gb"], "they need 8 compute slices, a GPU has 7"),
        (["1g.20gb"] * 4 + ["1g.10gb"], "they need 9 memory slices, a GPU has 8"),
        (["1g.10gb+me", "1g.10gb+me"], "at most 1 1g.10gb+me on one GPU, 2 asked"),
    ],
)
def test_a_geometry_that_does_not_fit_says_why(names: list[str], why: str) -> None:
    with pytest.raises(MigGeometryError) as caught:
        plan_geometry(h100(), names)
    assert str(caught.value).startswith(f"{', '.join(names)} do not fit on a H100-80GB: ")
    assert why in str(caught.value)
    assert fits_some_product(names) is not None


def test_a_profile_of_another_product_is_refused_by_name() -> None:
    with pytest.raises(
        MigGeometryError, match=r"a H100-80GB has no MIG profile '1g\.5gb' \(its profiles: 1g\.10gb"
    ):
        plan_geometry(h100(), ["1g.5gb"])


def test_products_are_found_by_model_and_memory() -> None:
    assert product_for("NVIDIA H100 80GB HBM3", 81559) is product("H100-80GB")
    assert product_for("NVIDIA A100-SXM4-40GB", 40960) is product("A100-40GB")
    assert product_for("NVIDIA A100 80GB PCIe", 81920) is product("A100-80GB")
    assert product_for("NVIDIA H200", 143771) is product("H200-141GB")
    assert product_for("NVIDIA H100 NVL", 95830) is None  # not tabled
    assert product_for("Tesla T4", 15360) is None
