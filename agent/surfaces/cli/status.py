"""Show what the running agent does: per GPU and container the request, cap, policy,
measured use, duty cycle, memory used and quota, and its recent actions. Reads the
agent's status socket (root only: it names the node's pods)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from agent.settings import EnforcementSettings
from agent.surfaces.cli.statusrender import render_status
from agent.surfaces.statusclient import (
    DEFAULT_TIMEOUT_S,
    NoStatusSocketError,
    StatusUnavailableError,
    fetch_status,
)

DEFAULT_SOCKET = EnforcementSettings().status_socket
MIN_WATCH_S = 0.1
_CLEAR = "\x1b[H\x1b[2J"  # cursor home + clear screen, as `watch` does


class _Unreadable(Exception):
    """The status could not be shown; the message is for the user as it is."""


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """Register ``vcuda-agent status`` on the subcommands ``sub``."""
    p = sub.add_parser(
        "status",
        parents=[common],
        help="show caps, measured use, duty cycles and memory per container",
        description=__doc__,
    )
    p.add_argument(
        "--socket",
        default=str(DEFAULT_SOCKET),
        metavar="PATH",
        help=f"the agent's status socket (default {DEFAULT_SOCKET})",
    )
    p.add_argument("--json", action="store_true", help="print the raw status document (JSON)")
    p.add_argument(
        "--watch",
        type=_watch_seconds,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C, like `watch`",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    socket_path = Path(args.socket)
    as_json = bool(getattr(args, "json", False))
    interval = getattr(args, "watch", None)
    try:
        if interval:
            return watch(socket_path, float(interval), as_json)
        print(show(socket_path, as_json))
    except _Unreadable as err:
        print(f"vcuda-agent status: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def show(socket_path: Path, as_json: bool, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """The status as text (or JSON); raises _Unreadable with the message to print."""
    try:
        doc = fetch_status(socket_path, timeout)
    except NoStatusSocketError as err:
        raise _Unreadable(
            f"no agent is running here (no status socket at {err.path}); "
            "start it with `vcuda-agent run` or pass --socket"
        ) from err
    except StatusUnavailableError as err:
        raise _Unreadable(str(err)) from err
    if as_json:
        return json.dumps(doc, indent=2)
    return _render(doc)


def watch(socket_path: Path, interval: float, as_json: bool, rounds: int | None = None) -> int:
    """Redraw every ``interval`` seconds until Ctrl-C (or ``rounds`` frames, for tests).
    An unreachable agent is shown on the screen and retried, as `watch` shows a failing
    command: the agent may be restarting. Returns 1 if the last frame was an error."""
    out: TextIO = sys.stdout
    frame = 0
    ok = True
    try:
        while True:
            try:
                body, ok = show(socket_path, as_json), True
            except _Unreadable as err:
                body, ok = f"vcuda-agent status: {err}", False
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            top = _CLEAR if out.isatty() else ("\n" if frame else "")
            out.write(f"{top}Every {interval:g}s: vcuda-agent status --socket {socket_path}  {stamp}\n\n")
            out.write(body + "\n")
            out.flush()
            frame += 1
            if rounds is not None and frame >= rounds:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    return 0 if ok else 1


def _render(doc: dict[str, Any]) -> str:
    try:
        return render_status(doc)
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        # The renderer reads defensively; this is the last line against a document shape
        # it did not foresee, so the user sees a message instead of a traceback.
        raise _Unreadable(f"cannot show this status document ({err}); try --json") from err


def _watch_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and seconds >= MIN_WATCH_S):
        raise argparse.ArgumentTypeError(f"must be at least {MIN_WATCH_S} s")
    return seconds
