"""What the dashboard tests read from dashboards/*.json and docs/metrics.md: panels and their
PromQL targets, the metric selectors in an expression, the labels a legend uses, and the
documented metric families with their labels. Shared by the structure test (no Prometheus)
and the integration test (every query through a real Prometheus)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# Series Prometheus itself writes for every target: fine in a panel, not in docs/metrics.md.
PROMETHEUS_SERIES = frozenset(
    {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added"}
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# | `name` | type | unit | labels | when | meaning |
_DOC_ROW = re.compile(r"^\|\s*`([a-z_:]+)`\s*\|\s*(\w+)\s*\|[^|]*\|\s*([^|]*?)\s*\|")
_LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
# One scan over a PromQL expression; the first alternative that matches at a position wins,
# so strings, ranges and grouping clauses are consumed whole and never read as metric names.
_BRACES = r"""\{(?:"(?:[^"\\]|\\.)*"|[^}"])*\}"""  # label matchers; a "}" in a string is text
_TOKEN = re.compile(
    rf"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<range>\[[^\]]*\])
    |(?P<grouping>\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))
    |(?P<number>\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
    |(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<matchers>\s*{_BRACES})?
    |(?P<bare>{_BRACES})""",
    re.VERBOSE,
)
_CALL = re.compile(r"\s*(?:\(|(?:by|without)\s*\()")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
)


@dataclass(frozen=True)
class Family:
    name: str  # as exposed: counters with _total, histograms without a suffix
    kind: str
    labels: frozenset[str]


@dataclass(frozen=True)
class Target:
    dashboard: str  # file name
    panel: str  # panel title
    panel_type: str
    ref_id: str
    expr: str
    legend: str
    table: bool
    columns: frozenset[str]  # labels a table panel lays out as columns (its organize step)

    def where(self) -> str:
        return f"{self.dashboard} / panel {self.panel!r} / target {self.ref_id}: {self.expr}"


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: str  # the text between braces, "" when there are none


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path.name}: not a JSON object"
    return data


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel with queries, rows' nested panels included (rows themselves have none)."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def table_columns(panel: Mapping[str, Any]) -> frozenset[str]:
    """Label columns a panel's "organize" transformation orders (not Time or Value #X)."""
    columns: set[str] = set()
    for step in panel.get("transformations", []):
        if step.get("id") == "organize":
            columns |= set(step.get("options", {}).get("indexByName", {}))
    return frozenset(c for c in columns if c != "Time" and not c.startswith("Value"))


def targets(path: Path) -> Iterator[Target]:
    for panel in panels(load(path)):
        columns = table_columns(panel)
        for target in panel.get("targets", []):
            yield Target(
                dashboard=path.name,
                panel=str(panel.get("title", "")),
                panel_type=str(panel.get("type", "")),
                ref_id=str(target.get("refId", "")),
                expr=str(target.get("expr", "")),
                legend=str(target.get("legendFormat", "")),
                table=target.get("format") == "table",
                columns=columns,
            )


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def variable_query(variable: Mapping[str, Any]) -> str:
    """A query variable's PromQL (``label_values(...)``), whichever form the JSON uses."""
    query = variable.get("query")
    if isinstance(query, Mapping):
        return str(query.get("query", ""))
    return str(query or variable.get("definition", ""))


def legend_labels(legend: str) -> set[str]:
    return set(_LEGEND_LABEL.findall(legend))


def selectors(expr: str) -> list[Selector]:
    """Metric selectors in ``expr`` (function and aggregation names are not selectors)."""
    found = []
    for match in _TOKEN.finditer(expr):
        name = match.group("name")
        if name is None or name in _KEYWORDS:
            continue
        if match.group("matchers") is None and _CALL.match(expr, match.end()):
            continue  # rate(, sum(, sum by (...) (, histogram_quantile(...
        matchers = match.group("matchers")
        found.append(Selector(name, matchers.strip()[1:-1] if matchers else ""))
    return found


def documented_families(doc: Path = METRICS_DOC) -> dict[str, Family]:
    """{exposed name: family} from the tables of docs/metrics.md."""
    families = {}
    for line in doc.read_text().splitlines():
        match = _DOC_ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            names = {label.strip() for label in labels.split(",")} - {"", "-"}
            families[name] = Family(name, kind, frozenset(names))
    return families


def family_of(metric: str, families: Mapping[str, Family]) -> Family | None:
    """The documented family a series name belongs to (histograms: _bucket, _sum, _count)."""
    if metric in families:
        return families[metric]
    for suffix in HISTOGRAM_SUFFIXES:
        family = families.get(metric.removesuffix(suffix)) if metric.endswith(suffix) else None
        if family is not None and family.kind == "histogram":
            return family
    return None
