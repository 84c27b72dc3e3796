"""The watchdog: a separate process that thaws everything in the freeze journal when the agent dies.

The agent holds the write end of a pipe that is the watchdog's stdin. However the agent
ends (SIGKILL, OOM kill, crash, or a clean stop that closes the pipe), the kernel closes
that end, the watchdog's read returns EOF, and it runs ``thaw_everything`` on the journal
and exits. It runs in its own session and ignores SIGINT/SIGTERM/SIGHUP, so a terminal's
Ctrl-C or signals meant for the agent do not end it first.

What it cannot survive: being killed together with the agent (a container stop kills
every process of the container). The next agent's start-up thaw covers that case.

Run as ``python -m agent.platform.watchdog --journal PATH``; it imports only the
stdlib and agent.platform modules so it is ready within tens of milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from agent.errors import PlatformError
from agent.platform.freezejournal import thaw_everything

log = logging.getLogger("agent.platform.watchdog")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the agent's (cli/main.py)
READY = b"ready\n"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the agent package


class WatchdogError(PlatformError):
    """The watchdog process could not be started."""


class WatchdogHandle:
    """The agent's side of a running watchdog: the pipe whose closing makes it thaw everything."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout_s: float = 2.0) -> int | None:
        """Clean stop: close the pipe (the watchdog thaws what the journal still lists) and
        wait up to ``timeout_s``; the exit code, or None if it is still thawing."""
        _live.discard(self)
        stdin = self._proc.stdin
        if stdin is not None and not stdin.closed:
            stdin.close()
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("watchdog (pid %d) has not exited %.1f s after the pipe closed", self.pid, timeout_s)
            return None

    def _detach_in_forked_child(self) -> None:
        # A child forked without exec (multiprocessing "fork") would inherit the write end
        # and keep the watchdog from seeing EOF when the agent dies: point it at /dev/null.
        stdin = self._proc.stdin
        if stdin is not None and not stdin.closed:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stdin.fileno(), inheritable=False)
            os.close(null)


# Strong references: a handle the caller dropped must not close the pipe when it is
# garbage-collected (that would thaw everything while the agent still runs).
_live: set[WatchdogHandle] = set()
_fork_hook_lock = threading.Lock()
_fork_hook_installed: list[bool] = []  # one element once os.register_at_fork was called


def _after_fork_in_child() -> None:
    for handle in list(_live):
        handle._detach_in_forked_child()


def spawn_watchdog(
    journal_path: Path, *, stderr: int | IO[bytes] | None = None, ready_timeout_s: float = 10.0
) -> WatchdogHandle:
    """Start the watchdog for ``journal_path`` and wait until it is ready (its signals
    ignored, its modules imported). ``stderr``: where it logs (default: the agent's)."""
    with _fork_hook_lock:
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed.append(True)
    env = dict(os.environ)
    # cwd "/" so nothing in the agent's working directory can shadow a module; the package
    # is found through PYTHONPATH whether it is installed or run from a checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "agent.platform.watchdog", "--journal", str(journal_path.absolute())]
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
            close_fds=True,
            cwd="/",
            env=env,
        )
    except OSError as err:
        raise WatchdogError(f"cannot start the watchdog: {err}") from err
    assert proc.stdout is not None
    try:
        ready = _read_line(proc.stdout.fileno(), ready_timeout_s)
    finally:
        proc.stdout.close()
    if ready != READY:
        proc.kill()
        code = proc.wait()
        raise WatchdogError(f"the watchdog did not start (exit code {code}, said {ready!r})")
    handle = WatchdogHandle(proc)
    _live.add(handle)
    log.info("watchdog (pid %d) will thaw %s if the agent dies", proc.pid, journal_path)
    return handle


def _read_line(fd: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    return data


def main(argv: Sequence[str] | None = None) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m agent.platform.watchdog", description=__doc__)
    parser.add_argument("--journal", required=True, type=Path, help="the freeze journal to thaw")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    agent_pid = os.getppid()
    _say_ready()
    _wait_for_eof()
    report = thaw_everything(args.journal)
    log.info("agent (pid %d) is gone: %s", agent_pid, report.summary())
    return 0


def _say_ready() -> None:
    try:
        os.write(1, READY)
    except OSError as err:  # the agent gave up waiting; EOF on stdin follows
        log.warning("could not report readiness: %s", err)
    # Nothing else goes to stdout (the agent closed its end): keep fd 1 valid but harmless.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def _wait_for_eof() -> None:
    while True:
        try:
            if not os.read(0, 4096):
                return
        except OSError as err:  # a broken stdin means the agent is gone as well
            log.warning("reading the agent's pipe failed (%s): thawing", err)
            return


if __name__ == "__main__":
    raise SystemExit(main())
