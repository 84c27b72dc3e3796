"""README's configuration reference against the code: every option of every command,
every node-config field and every annotation the code reads or writes must be there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from agent.control.guardtargets import EXEMPT_ANNOTATION
from agent.domain import annotations as notes
from agent.domain import nodeconfig, nodeinventory, schedrequest
from agent.surfaces.cli.main import build_parser

README = (Path(__file__).parents[2] / "README.md").read_text()


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        s
        for action in parser._actions
        for s in action.option_strings
        if s.startswith("--") and s != "--help" and action.help != argparse.SUPPRESS
    ]


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_command_and_option_is_in_the_readme(command: str) -> None:
    parser = _commands()[command]
    assert f"vcuda-agent {command}" in README, f"`vcuda-agent {command}` is not in README.md"
    section = README if command != "run" else README.split("### `vcuda-agent run`")[1].split("### ")[0]
    missing = [o for o in _options(parser) if not re.search(rf"(?<![\w-]){o}(?![\w-])", section)]
    assert not missing, f"options of `vcuda-agent {command}` missing from README.md: {missing}"


def test_the_run_table_lists_every_run_option_in_its_own_row() -> None:
    table = README.split("### `vcuda-agent run`")[1].split("### ")[0]
    rows = {
        line.split("|")[1].strip().strip("`").split()[0]
        for line in table.splitlines()
        if line.startswith("| `")
    }
    assert set(_options(_commands()["run"])) <= rows | {"--help"}


def test_the_run_table_gives_each_numeric_option_the_default_the_parser_has() -> None:
    table = README.split("### `vcuda-agent run`")[1].split("### ")[0]
    shown = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.split("|")]
            shown[cells[1].strip("`").split()[0]] = cells[2].strip("`")
    compared, wrong = 0, []
    for action in _commands()["run"]._actions:
        default = action.default
        if not isinstance(default, (int, float)) or isinstance(default, bool):
            continue
        for option in action.option_strings:
            if option not in shown:
                continue
            compared += 1
            try:
                same = float(shown[option]) == float(default)
            except ValueError:
                same = False
            if not same:
                wrong.append(f"{option}: README says {shown[option]!r}, the parser {default!r}")
    assert compared >= 5, f"only {compared} numeric defaults found in the run table"
    assert not wrong, wrong


def test_every_node_config_field_is_in_the_readme() -> None:
    for name in nodeconfig._NODE_FIELDS:
        assert f"`{name}" in README or f"`nodeConfig[].{name}`" in README, name


@pytest.mark.parametrize(
    "key",
    [
        notes.CORE_LIMIT,
        notes.POLICY,
        notes.PREDICATE_NODE,
        notes.PREDICATE_TIME,
        notes.GPU_ASSIGNED,
        notes.PREDICATE_IDX + "<i>",
        notes.PREDICATE_IDX_INIT + "<i>",
        schedrequest.NODE_POLICY,
        schedrequest.GPU_POLICY,
        EXEMPT_ANNOTATION,
        nodeinventory.INVENTORY_ANNOTATION,
        nodeinventory.PRODUCT_LABEL,
        nodeinventory.COUNT_LABEL,
        nodeinventory.MEMORY_LABEL,
    ],
)
def test_every_annotation_and_label_is_in_the_readme(key: str) -> None:
    assert f"`{key}" in README, f"{key} is not documented in README.md"


@pytest.mark.parametrize("policy", [p.value for p in notes.Policy])
def test_every_policy_is_in_the_readme(policy: str) -> None:
    assert f"`{policy}`" in README
