"""Every Grafana panel's PromQL through a real Prometheus scraping a running `vcuda-agent demo`:
Debian's prometheus on loopback (1 s scrapes, a throw-away TSDB) scrapes the demo's live act
(a 4-GPU simulated node with real containers under enforcement, GPU 3 in MIG mode), and each
query, with the template variables filled in as Grafana would (All, then the values the
variable queries offer), must return series carrying every label its legend or table uses."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.integration.prometheus import JOB, Prometheus, free_port, running_prometheus
from tests.unit import dashboard_model as model

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

DEMO_DURATION_S = 60
# The live act's events (an XID 3 s in, a pod killed over its memory quota, a neighbour at
# 14 s) come once its pods are admitted, which takes 15 s on an idle 2-core machine and far
# longer on a loaded one: poll while the demo's agent serves, up to this cap.
DATA_DEADLINE_S = 150
POLL_S = 2.0
# Grafana's built-in interval variables for a 1 s scrape interval and a short time range.
BUILTINS = {
    "__rate_interval": "10s",
    "__interval": "5s",
    "__interval_ms": "5000",
    "__range": "1m",
    "__range_s": "60",
    "__range_ms": "60000",
}
# Panels the demo cannot fill, and why. Their queries must return nothing: a panel listed
# here that returns data fails the test, so the list cannot go stale. None today: the demo's
# workloads make driver calls for the tracer and its agent runs the device guard.
NO_DATA_IN_DEMO: dict[tuple[str, str], str] = {}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name in BUILTINS:
            return BUILTINS[name]
        raise AssertionError(f"no value for ${name} in {expr}")

    return _VARIABLE.sub(value, expr)


def regex_of(options: list[str]) -> str:
    """Grafana's format for a multi-value variable in a Prometheus regex."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", option) for option in options]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def selected_values(prometheus: Prometheus, path: Path) -> dict[str, str]:
    """Run the dashboard's variable queries as Grafana does and select every value offered."""
    values: dict[str, str] = {}
    for name, variable in model.variables(model.load(path)).items():
        if variable["type"] != "query":
            continue
        match = _LABEL_VALUES.match(model.variable_query(variable))
        assert match, f"{path.name}: ${name} is not a label_values() query"
        options = prometheus.label_values(match.group(2), substitute(match.group(1), values))
        assert options, f"{path.name}: ${name} offers no values ({model.variable_query(variable)})"
        values[name] = regex_of(options)
    return values


def problems(prometheus: Prometheus, target: model.Target, values: Mapping[str, str]) -> list[str]:
    expr = substitute(target.expr, values)
    where = f"{target.dashboard} / {target.panel!r} / {target.ref_id}: {expr}"
    try:
        series = prometheus.query(expr)
    except AssertionError as err:
        return [f"query error {err}: {where}"]
    if not series:
        return [f"no data: {where}"]
    wanted = model.legend_labels(target.legend) | (target.columns if target.table else frozenset())
    lacking = [sample["metric"] for sample in series if not wanted <= set(sample["metric"])]
    if lacking:
        missing = sorted(wanted - set(lacking[0]))
        return [f"{len(lacking)} of {len(series)} series lack {missing}, e.g. {lacking[0]}: {where}"]
    return []


def all_targets() -> list[model.Target]:
    return [target for path in model.dashboard_files() for target in model.targets(path)]


@contextlib.contextmanager
def running_demo(workdir: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`vcuda-agent demo`'s live act serving metrics on ``port``; stopped with SIGINT (the demo
    cleans up its agent, containers and cgroups), killed as a last resort."""
    out = workdir / "demo.out"
    cmd = [sys.executable, "-m", "agent", "demo", "--no-intro", "--duration", str(DEMO_DURATION_S)]
    cmd += ["--metrics-address", f"127.0.0.1:{port}"]
    with out.open("wb") as log:
        demo = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=model.ROOT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while f"metrics: http://127.0.0.1:{port}/metrics" not in out.read_text(errors="replace"):
            if demo.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the demo did not serve metrics:\n{out.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.2)
        yield demo
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)  # its own session: only what it started
                demo.wait()


def wait_for_scrapes(prometheus: Prometheus, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    expr = f'count_over_time(up{{job="{JOB}"}}[1m]) >= {count} and up{{job="{JOB}"}} == 1'
    while not prometheus.query(expr):
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} successful scrapes in {timeout_s} s")
        time.sleep(0.5)


EVERYTHING = {"node": ".*", "namespace": ".*"}  # "All" selected: allValue is .*


def failing_queries(prometheus: Prometheus, targets: list[model.Target]) -> list[str]:
    """Every target with All selected, then with the values the variable queries offer."""
    failures = [p for t in targets for p in problems(prometheus, t, EVERYTHING)]
    try:
        chosen = {path.name: selected_values(prometheus, path) for path in model.dashboard_files()}
    except AssertionError as err:  # a variable offers nothing yet
        return [*failures, str(err)]
    return failures + [p for t in targets for p in problems(prometheus, t, chosen[t.dashboard])]


def test_every_panel_query_returns_data_with_the_labels_it_shows(short_dir: Path) -> None:
    targets = all_targets()
    expected = [t for t in targets if (t.dashboard, t.panel) not in NO_DATA_IN_DEMO]
    listed = [t for t in targets if (t.dashboard, t.panel) in NO_DATA_IN_DEMO]
    assert {(t.dashboard, t.panel) for t in listed} == set(NO_DATA_IN_DEMO), "an allow-listed panel is gone"
    port = free_port()
    with (
        running_prometheus(short_dir / "prometheus", f"127.0.0.1:{port}") as prometheus,
        running_demo(short_dir, port) as demo,
    ):
        started = time.monotonic()
        wait_for_scrapes(prometheus, 3, timeout_s=20)
        # The demo's events (an XID, a pod killed over its memory quota, a neighbour arriving)
        # come while it runs: poll until every panel has data or the time is up.
        failures = failing_queries(prometheus, expected)
        while failures and time.monotonic() - started < DATA_DEADLINE_S:
            if demo.poll() is not None or not prometheus.query(f'max_over_time(up{{job="{JOB}"}}[10s]) == 1'):
                failures.append(f"the demo's agent stopped serving (demo exit code {demo.poll()})")
                break
            time.sleep(POLL_S)
            failures = failing_queries(prometheus, expected)
        for target in listed:
            if prometheus.query(substitute(target.expr, EVERYTHING)):
                where = f"{target.dashboard} / {target.panel!r}"
                failures.append(f"returns data, remove it from NO_DATA_IN_DEMO: {where}")
    assert demo.returncode != -signal.SIGKILL, "the demo did not stop on SIGINT within 30 s"
    if failures:
        pytest.fail(f"{len(failures)} panel queries failed:\n" + "\n".join(failures), pytrace=False)
