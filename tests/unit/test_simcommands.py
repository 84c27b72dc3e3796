"""The demo's and the simulated node's commands are declared apart from their implementations
(agent/surfaces/cli/simcommands.py): what the declarations repeat must stay what the
implementations use."""

from __future__ import annotations

import argparse

import pytest

from agent.platform.gpu.sim.programs import PATTERNS
from agent.surfaces.cli import simcommands
from agent.surfaces.cli.main import build_parser


def test_the_patterns_offered_are_the_simulators() -> None:
    assert simcommands.PATTERNS == PATTERNS


@pytest.mark.parametrize(
    ("argv", "module", "function"),
    [
        (["demo"], "agent.surfaces.cli.demo", "main"),
        (["sim-gpu", "--simulate", "1xT4-16GB"], "agent.surfaces.cli.sim", "gpu_main"),
        (["sim-workload", "--gpu", "0"], "agent.surfaces.cli.sim", "workload_main"),
        (["sim-event", "--gpu", "0", "--lost"], "agent.surfaces.cli.sim", "event_main"),
        (["sim-mps-control"], "agent.surfaces.cli.sim", "mps_main"),
    ],
)
def test_each_command_runs_its_implementation(
    argv: list[str], module: str, function: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The declared command imports its implementation when it runs, and calls it with the
    parsed arguments."""
    seen: list[argparse.Namespace] = []

    def implementation(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    monkeypatch.setattr(f"{module}.{function}", implementation)
    args = build_parser().parse_args(argv)
    assert args.func(args) == 7
    assert seen == [args]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_sim_mps_control_prints_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    args = _commands()["sim-mps-control"].parse_args(["-h"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == simcommands.SIM_MPS_CONTROL_DESCRIPTION + "\n"
