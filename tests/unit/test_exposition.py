"""/metrics rendering: our renderer is byte-for-byte prometheus_client's generate_latest (on a
node with every collector branch, on the bench's full node and on fuzzed families of every
type), the collectors' text is the golden one recorded before they stopped calling
add_metric, and a scrape shows the state at scrape time."""

from __future__ import annotations

import importlib.util
import math
import random
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.samples import Timestamp

from agent.control.containers import ContainerControl, EnforcerStats
from agent.domain.dutycontrol import DutyState
from agent.surfaces.metrics.enforcement_collector import EnforcementCollector
from agent.surfaces.metrics.exposition import render
from agent.surfaces.metrics.families import CONTAINER_LABELS, adder, container_labels
from agent.surfaces.metrics.http import MetricsServer
from tests.unit import scrape_state

GOLDEN = Path(__file__).with_name("scrape_golden.prom")
ROOT = Path(__file__).resolve().parents[2]


class Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def registry_of(*collectors: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


# The collectors' output ---------------------------------------------------------------------
def test_collectors_render_the_golden_text_both_ways() -> None:
    # Recorded with generate_latest before the collectors built samples themselves: names,
    # labels, types, values and order all unchanged.
    golden = GOLDEN.read_bytes()
    registry = scrape_state.registry()
    assert generate_latest(registry) == golden
    assert render(registry) == golden
    assert b'pod="odd\\"name\\\\x"' in golden  # the escaping case is in there
    assert b"e+09" in golden  # and Go's exponent form


def test_the_bench_node_renders_as_generate_latest_does() -> None:
    loader = importlib.util.spec_from_file_location("bench_scrape", ROOT / "bench" / "scrape.py")
    assert loader is not None and loader.loader is not None
    scrape = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(scrape)
    registry = registry_of(*scrape.synthetic_state(2, 4).values())
    text = render(registry)
    assert text == generate_latest(registry)
    assert text.count(b"\n") > 250


def test_a_scrape_shows_the_state_at_scrape_time() -> None:
    spec = scrape_state.SPECS[0]
    control = ContainerControl(spec=spec, key=spec.label, state=DutyState(duty=0.5), used=10.0, goal=20.0)
    controls = [control]
    enforcer = SimpleNamespace(
        gpu_views=dict, controls=lambda: list(controls), stats=EnforcerStats(), measured=lambda _c: True
    )
    memory = SimpleNamespace(
        usage_by_container=dict,
        gpu_used_mib=lambda _: None,
        guard=SimpleNamespace(stats=dict),
        mode="kill",
        read_errors=0,
    )
    enforcement: Any = SimpleNamespace(
        enforcer=enforcer,
        memory=memory,
        watchdog_state=lambda: "running",
        journal=SimpleNamespace(write_error=None),
    )
    registry = registry_of(EnforcementCollector(enforcement, scrape_state.GPUS, "n1"))
    first = render(registry)
    assert b'pod="fixed-a"} 0.1\n' in first
    control.used, control.goal = 42.0, None
    renamed = scrape_state.SPECS[1]
    controls.append(ContainerControl(spec=renamed, key=renamed.label, state=DutyState(), used=5.0))
    second = render(registry)
    assert second == generate_latest(registry)
    assert b'pod="fixed-a"} 0.42\n' in second
    assert b'vcuda_container_target_ratio{container="worker",gpu="0",namespace="team-a"' not in second
    assert b'namespace="team-b",node="n1",pod="fixed-b"} 0.05\n' in second
    controls.clear()
    assert b"pod=" not in render(registry)


def test_the_endpoint_serves_the_rendered_text() -> None:
    registry = scrape_state.registry()
    server = MetricsServer("127.0.0.1", 0, registry, lambda: (True, "ready"))
    server.start()
    try:
        host, port = server.address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            body = response.read()
            content_type = response.headers["Content-Type"]
    finally:
        server.stop()
    assert body == GOLDEN.read_bytes()
    assert content_type == CONTENT_TYPE_LATEST


# Families -----------------------------------------------------------------------------------
def test_adder_makes_the_samples_add_metric_makes() -> None:
    names = ["node", "pod"]
    for kind in (GaugeMetricFamily, CounterMetricFamily):
        ours, theirs = kind("x", "help", labels=names), kind("x", "help", labels=names)
        add = adder(ours)
        for pod, value in (("a", 1.5), ("b", 0.0), ('c"\\', math.inf)):
            add({"node": "n", "pod": pod}, value)
            theirs.add_metric(["n", pod], value)
        assert ours.samples == theirs.samples
        assert ours == theirs


def test_adder_refuses_families_with_other_samples() -> None:
    with pytest.raises(TypeError, match="histogram"):
        adder(HistogramMetricFamily("h", "help", labels=["node"]))  # type: ignore[arg-type]


def test_container_labels_follow_the_declared_names() -> None:
    whole = scrape_state.SPECS[4]
    labels = container_labels("n1", whole)
    assert tuple(labels) == CONTAINER_LABELS
    assert labels == {
        "node": "n1",
        "namespace": "team-a",
        "pod": "whole",
        "container": "worker",
        "gpu": "1,2",
    }


# The renderer against generate_latest -------------------------------------------------------
SUFFIXES = ("", "_total", "_created", "_gsum", "_gcount", "_bucket", "_sum", "_count", "_info", "_other")
LABEL_NAMES = ("a", "b_1", "le", "node", "Zed", "weird.name", "x-y", "9lead")
VALUE_CHARS = 'ab0_-. "\\\n\té✓\U0001f600'
VALUES: tuple[Any, ...] = (
    0.0, -0.0, 1, 7, True, 0.5, 1.5, -2.25, 999999.9999, 1e6, 1e6 - 1e-9, 1234567.0, 1e16, 1e-7, 123456789.5,
    2**60, -1e9, math.inf, -math.inf, math.nan,
)  # fmt: skip
TIMESTAMPS: tuple[Any, ...] = (None, None, None, 1.5, 0, 1700000000.123, Timestamp(12, 5000000))


def fuzzed_family(rng: random.Random, index: int) -> Metric:
    kind = rng.choice(
        ("counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info", "stateset")
    )
    name = rng.choice((f"fam_{index}", f"fam:{index}", f"fam.dot_{index}"))
    documentation = rng.choice(("plain", "with \\ backslash", "two\nlines", "", 'ünïcode "quoted"'))
    metric = Metric(name, documentation, kind)
    for _ in range(rng.randrange(0, 12)):
        keys = rng.sample(LABEL_NAMES, rng.randrange(0, 4))
        labels = {k: "".join(rng.choice(VALUE_CHARS) for _ in range(rng.randrange(0, 5))) for k in keys}
        if rng.random() < 0.3:
            labels = dict(reversed(labels.items()))  # the same set in another order
        metric.add_sample(name + rng.choice(SUFFIXES), labels, rng.choice(VALUES), rng.choice(TIMESTAMPS))
    return metric


def test_fuzzed_families_render_as_generate_latest_does() -> None:
    rng = random.Random(20261122)
    for round_ in range(150):
        families = [fuzzed_family(rng, i) for i in range(rng.randrange(1, 6))]
        registry = registry_of(Fixed(families))
        assert render(registry) == generate_latest(registry), f"round {round_}"


def test_a_repeated_label_set_renders_each_time() -> None:
    family = Metric("m", "help", "gauge")
    labels = {"b": "2", "a": 'x"y'}
    for value in (1.0, 2.0):
        family.add_sample("m", labels, value)
    family.add_sample("m", {"a": 'x"y', "b": "2"}, 3.0)
    text = render(registry_of(Fixed([family])))
    assert text.count(b'm{a="x\\"y",b="2"}') == 3
    assert text == generate_latest(registry_of(Fixed([family])))


def test_a_bad_sample_fails_as_in_generate_latest() -> None:
    family = Metric("m", "help", "gauge")
    family.add_sample("m", {"a": None}, 1.0)  # type: ignore[dict-item]
    registry = registry_of(Fixed([family]))
    with pytest.raises(AttributeError) as theirs:
        generate_latest(registry)
    with pytest.raises(AttributeError) as ours:
        render(registry)
    assert ours.value.args[-1] is family
    assert type(ours.value) is type(theirs.value)


def test_more_label_sets_than_the_cache_holds_still_render_right() -> None:
    family = Metric("m", "help", "gauge")
    for i in range(9000):  # past the label-set LRU's 8192: evictions on the way
        family.add_sample("m", {"pod": f"p{i}", "node": "n"}, float(i))
    registry = registry_of(Fixed([family]))
    first = render(registry)
    assert first == generate_latest(registry)
    assert render(registry) == first
    assert b'm{node="n",pod="p8999"} 8999.0\n' in first
