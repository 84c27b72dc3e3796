"""Hypothesis profiles for the fuzz suite, and the case count printed at the end of a run.

``ci`` (the default, so ``make test`` runs the suite in CI) is derandomized: the same cases on
every run, bounded to keep tests/fuzz under a minute on two cores. ``deep`` explores more:
``pytest tests/fuzz --hypothesis-profile deep``; ``--hypothesis-seed N`` replays a random run.
The profiles are registered here, so ``--hypothesis-profile`` needs tests/fuzz (or a file in it)
among the arguments: under a plain ``pytest`` this conftest loads after hypothesis reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

from tests.fuzz.tally import CASES

# Deadline: a generous per-case bound that still fails a parse that hangs or goes quadratic,
# without flaking on a busy shared machine.
# No example database: a fixed CI run needs none, and it would leave .hypothesis/ in the tree.
_BASE = settings(
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    database=None,
)
settings.register_profile("ci", _BASE, derandomize=True, max_examples=250)
settings.register_profile("deep", _BASE, max_examples=3000)
settings.load_profile("ci")


@pytest.hookimpl(trylast=True)  # after hypothesis's own plugin has loaded --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    # derandomize ignores --hypothesis-seed: a seeded run gets the same profile, randomized.
    if config.getoption("--hypothesis-seed", default=None) is None:
        return
    base = settings.get_current_profile_name()
    settings.register_profile(f"{base}-seeded", settings.get_profile(base), derandomize=False)
    settings.load_profile(f"{base}-seeded")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES:
        terminalreporter.write_line(f"fuzz: {sum(CASES.values())} cases over {len(CASES)} inputs")


@pytest.fixture(autouse=True, scope="package")
def _quiet_agent_logs() -> Iterator[None]:
    # Every refused case logs a warning; thousands of them would bury a failure's report.
    agent = logging.getLogger("agent")
    level = agent.level
    agent.setLevel(logging.CRITICAL)
    yield
    agent.setLevel(level)
