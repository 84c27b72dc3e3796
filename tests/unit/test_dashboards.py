"""The Grafana dashboards' structure, without Grafana or Prometheus: importable anywhere (no
hard-coded UIDs, the data source a variable), every panel filtered by the node and namespace
variables and with a unit, and every metric a query names documented in docs/metrics.md, so
renaming a metric without its dashboards fails here. The queries themselves run against a
real Prometheus in tests/integration/test_dashboards_prometheus.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit import dashboard_model as model

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILES = model.dashboard_files()
NAMES = [path.name for path in FILES]
# Labels Prometheus attaches to every scraped series (target labels).
TARGET_LABELS = {"instance", "job"}


def walk(node: Any, path: str = "$") -> Iterator[tuple[str, str, Any]]:
    """(path, key, value) for every key of every object in a JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}[{index}]")


def test_the_four_dashboards_are_there() -> None:
    assert NAMES == [
        "vcuda-agent.json",
        "vcuda-enforcement.json",
        "vcuda-node-gpu.json",
        "vcuda-workloads.json",
    ]


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_dashboard_is_importable_anywhere(path: Path) -> None:
    dashboard = model.load(path)
    assert dashboard.get("uid") is None, "a fixed dashboard uid collides on import: leave it out"
    assert dashboard.get("id") is None
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"].startswith("vcuda / ")
    assert "vcuda" in dashboard["tags"]
    assert "__inputs" not in dashboard, "export without 'share externally': the data source is a variable"
    for where, key, value in walk(dashboard):
        if key == "uid":
            assert value in (None, "${datasource}"), f"{path.name} {where}: hard-coded uid {value!r}"
        if key == "datasource":
            assert value == DATASOURCE, f"{path.name} {where}: datasource {value!r}"
    assert "${DS_" not in path.read_text()


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_variables_pick_the_data_source_node_and_namespace(path: Path) -> None:
    variables = model.variables(model.load(path))
    assert list(variables) == ["datasource", "node", "namespace"]
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for name in ("node", "namespace"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["multi"] is True and variable["includeAll"] is True
        assert variable["allValue"] == ".*"
        query = model.variable_query(variable)
        assert query.startswith("label_values(vcuda_") and query.endswith(f", {name})"), query
    assert '{node=~"$node"}' in model.variable_query(variables["namespace"])


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_every_panel_has_the_data_source_a_unit_and_queries(path: Path) -> None:
    found = list(model.panels(model.load(path)))
    assert len(found) >= 6
    titles = [panel["title"] for panel in found]
    assert len(set(titles)) == len(titles), "panel titles name panels in test failures: keep them unique"
    assert len({panel["id"] for panel in found}) == len(found)
    for panel in found:
        title = panel["title"]
        assert panel["datasource"] == DATASOURCE, title
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert panel.get("description"), f"{title}: no description"
        assert panel["targets"], f"{title}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, title
            assert target.get("expr", "").strip(), f"{title} {target.get('refId')}: empty expr"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, title


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_every_query_names_documented_metrics_filtered_by_the_variables(path: Path) -> None:
    families = model.documented_families()
    for target in model.targets(path):
        assert "$node" in target.expr, f"no $node filter: {target.where()}"
        found = model.selectors(target.expr)
        assert found, f"no metric: {target.where()}"
        labels = set(TARGET_LABELS)
        for selector in found:
            if selector.metric in model.PROMETHEUS_SERIES:
                continue
            family = model.family_of(selector.metric, families)
            assert family is not None, f"{selector.metric} is not in docs/metrics.md: {target.where()}"
            assert family.name.startswith("vcuda_"), (
                f"gpu-manager names are not for dashboards: {target.where()}"
            )
            labels |= family.labels | ({"le"} if family.kind == "histogram" else set())
            if "node" in family.labels:
                assert 'node=~"$node"' in selector.matchers, (
                    f"{selector.metric} without $node: {target.where()}"
                )
            if "namespace" in family.labels:
                assert 'namespace=~"$namespace"' in selector.matchers, (
                    f"{selector.metric} without $namespace: {target.where()}"
                )
        shown = model.legend_labels(target.legend) | (target.columns if target.table else frozenset())
        missing = shown - labels
        assert not missing, f"shows {sorted(missing)}, which no metric of the query has: {target.where()}"


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_refids_are_unique_within_a_panel(path: Path) -> None:
    for panel in model.panels(model.load(path)):
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]


def test_the_parser_finds_selectors_not_functions_or_labels() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (node, le) (rate(a_bucket{node=~"$node"}[$__rate_interval]))) '
        '/ on (node) group_left (gpu) b * 2e3 or vector(0) and count without (x) (c{y="}"})'
    )
    assert [(s.metric, s.matchers) for s in model.selectors(expr)] == [
        ("a_bucket", 'node=~"$node"'),
        ("b", ""),
        ("c", 'y="}"'),
    ]


def test_the_document_parser_reads_every_table() -> None:
    families = model.documented_families()
    assert len(families) >= 40
    loop = families["vcuda_control_loop_duration_seconds"]
    assert loop.kind == "histogram" and loop.labels == {"node"}
    assert model.family_of("vcuda_control_loop_duration_seconds_bucket", families) is loop
    assert model.family_of("vcuda_gpu_healthy_count", families) is None
    assert families["vcuda_container_cap_ratio"].labels == {"node", "namespace", "pod", "container", "gpu"}
