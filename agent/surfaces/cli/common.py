"""What every ``vcuda-agent`` command shares: the common options and logging set-up.
Light on purpose: the simulated workloads' fast start path imports it."""

from __future__ import annotations

import argparse
import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def common_options() -> argparse.ArgumentParser:
    """The parent parser of every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS, help="log verbosity (default INFO)"
    )
    return common


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
