"""docs/metrics.md cannot drift: a real agent in Kubernetes mode serves exactly the vcuda_*
families the document lists (conditional ones may be absent, nothing undocumented may appear)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster, metric, pod_manifest, scrape, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
GIB = 1024
# | `name` | type | unit | labels | when | meaning |
ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|\s*(\w+)\s*\|[^|]*\|[^|]*\|\s*([^|]*?)\s*\|")


def documented() -> dict[str, tuple[str, str]]:
    """{exposed family name: (type, when)} from the tables of docs/metrics.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def exposed_name(name: str, kind: str) -> str:
    """The name a reader sees in the exposition: the parser drops counters' _total."""
    return f"{name}_total" if kind == "counter" else name


def test_the_document_parses_and_follows_naming_conventions() -> None:
    rows = documented()
    assert len(rows) >= 40
    for name, (kind, _) in rows.items():
        assert kind in {"gauge", "counter", "histogram"}, name
        if not name.startswith("vcuda_"):
            continue  # gpu-manager's names are kept as they were, container_gpu_memory_total a gauge
        assert (kind == "counter") == name.endswith("_total"), name
        assert not re.search(r"_(mib|mb|ms|percent)(_|$)|_utilization$", name), f"{name}: base units"


def test_every_served_family_is_documented_and_every_unconditional_one_served(
    start_agent: Callable[..., AgentProcess], cluster: Cluster
) -> None:
    agent = start_agent("2xH100-80GB", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    cluster.node.run_pod(pod_manifest("doc", ("cuda", 30, 2 * GIB)))
    port = agent.metrics_port()
    wait_until(lambda: metric(scrape(port), "vcuda_container_request_cores", pod="doc") == 30, what="pod")
    served = {
        exposed_name(family.name, family.type): family.type
        for family in text_string_to_metric_families(scrape(port))
        if family.name.startswith("vcuda_")
    }
    rows = documented()
    undocumented = sorted(set(served) - set(rows))
    assert not undocumented, f"served but not in docs/metrics.md: {undocumented}"
    # This agent runs in Kubernetes mode with cgroups (root): these conditions all hold.
    expected = {"always", "kube", "kube+host"}
    missing = sorted(n for n, (_, when) in rows.items() if when in expected and n not in served)
    assert not missing, f"documented as always served but absent: {missing}"
    wrong = sorted(n for n, kind in served.items() if rows[n][0] != kind)
    assert not wrong, f"documented with another type: {wrong}"
