"""One MPS control daemon per GPU, run and watched by the agent.

Each daemon is ``<command> -f`` (foreground) with ``CUDA_VISIBLE_DEVICES`` set to its GPU's
UUID, and its pipe and log directories under ``<root>/<uuid>/``: the pipe directory is what
clients mount and name in ``CUDA_MPS_PIPE_DIRECTORY``. A daemon runs in a session of its own
and is recorded (pid + start time) in ``<root>/<uuid>/daemon.json``, so that it outlives an
agent restart (its clients would die with it) and the next agent adopts it instead of
starting a second one. A daemon that dies is restarted with a growing back-off (1 s to 30 s);
a command that cannot run at all, or dies three times in a row before its control socket
comes up, is reported as failed and not retried (the shares are held by the freezer).

The pipe directory is the agent's (clients get it read-only), but a daemon is never started
on what something else left there: symbolic links (the daemon writes its pid file through
whatever is at that path) and anything that is not a socket, pipe or regular file are
removed first. Once up, the control socket's identity (device, inode) is kept; a socket
that is replaced or gone while the daemon runs counts as the daemon's death: it is stopped
and restarted, and the reason is kept for status.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.errors import MpsCommandError, MpsUnavailableError, PlatformError, ProcessGoneError
from agent.platform.atomicfile import remove, write_atomic
from agent.platform.procfs import ProcessIdentity, ProcFS

log = logging.getLogger(__name__)

BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
# What reading daemon.json raises for any bytes in it (OverflowError: int(Infinity)).
_BAD_RECORD = (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError)
GIVE_UP_AFTER = 3  # starts in a row that died before their control socket came up
STOP_WAIT_S = 5.0


class DaemonState(enum.StrEnum):
    STOPPED = "stopped"
    RUNNING = "running"  # its control socket answers
    STARTING = "starting"  # started, control socket not there yet
    RESTARTING = "restarting"  # died; waiting out the back-off
    FAILED = "failed"  # cannot run at all (the command is missing or not executable)


@dataclass(frozen=True)
class DaemonStatus:
    gpu: int
    uuid: str
    state: DaemonState
    pid: int | None
    restarts: int
    error: str


def probe_command(command: Sequence[str]) -> str | None:
    """Why ``command`` cannot run here (None: it can)."""
    if not command:
        return "no MPS control daemon command is configured"
    program = command[0]
    found = (
        shutil.which(program) if "/" not in program else (program if os.access(program, os.X_OK) else None)
    )
    if found is None:
        return (
            f"{program} not found or not executable "
            "(install the NVIDIA compute utilities, or set --mps-control)"
        )
    return None


class MpsDaemon:
    """The control daemon of one GPU. Not thread-safe: one caller at a time (the pool's lock
    for its GPU); ``status()`` and the state attributes may be read from any thread. What
    keeps it from starting is MpsUnavailableError, a signal that cannot be sent
    MpsCommandError: PlatformErrors, never a bare OSError."""

    def __init__(
        self,
        gpu: int,
        uuid: str,
        command: Sequence[str],
        root: Path,
        *,
        procfs: ProcFS | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.gpu, self.uuid = gpu, uuid
        self._command = list(command)
        self.home = root / uuid
        self.pipe_dir = self.home / "pipe"
        self.log_dir = self.home / "log"
        self._record = self.home / "daemon.json"
        self._procfs = procfs or ProcFS()
        self._environ = dict(os.environ if environ is None else environ)
        self._child: subprocess.Popen[bytes] | None = None
        self._identity: ProcessIdentity | None = None
        self.state = DaemonState.STOPPED
        self.restarts = 0
        self.error = ""
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._exit_code: int | None = None
        self._early_deaths = 0
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of its control socket

    def status(self) -> DaemonStatus:
        pid = self._identity.pid if self._identity else None
        return DaemonStatus(self.gpu, self.uuid, self.state, pid, self.restarts, self.error)

    # Running --------------------------------------------------------------------------------
    def ensure(self, now: float) -> DaemonState:
        """Adopt a daemon a previous agent left, start one, or restart a dead one when its
        back-off is over; then see whether its control socket is up."""
        if self._identity is not None and not self._alive():
            self._died(now)
        if self.state is DaemonState.FAILED:
            return self.state
        if self._identity is None and self.state is not DaemonState.RESTARTING:
            self._identity = self._adopt()
            if self._identity is None:
                self._start()
        elif self.state is DaemonState.RESTARTING and now >= self._retry_at:
            self._start()
        socket_id = _socket_identity(self.pipe_dir / "control")
        if self.state is DaemonState.RUNNING and socket_id != self._socket_id:
            self._replace_tampered()
            socket_id = _socket_identity(self.pipe_dir / "control")
        if self._identity is not None and socket_id is not None:
            if self.state is not DaemonState.RUNNING:
                log.info(
                    "GPU %d: MPS control daemon pid %d is up (%s)",
                    self.gpu,
                    self._identity.pid,
                    self.pipe_dir,
                )
                self._socket_id = socket_id
            self.state = DaemonState.RUNNING
            self._backoff = BACKOFF_FIRST_S
        return self.state

    def _replace_tampered(self) -> None:
        """Its control socket was replaced or removed while it ran: whatever answers there now
        is not known to be the daemon. Stop it and start a fresh one."""
        self.error = f"its control socket {self.pipe_dir / 'control'} was replaced or removed while it ran"
        log.error(
            "GPU %d: the MPS control daemon's %s: restarting it", self.gpu, self.error.removeprefix("its ")
        )
        self.stop()
        self.restarts += 1
        self._start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Ensure it runs and wait up to ``timeout_s`` for its control socket."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.ensure(time.monotonic()) is DaemonState.RUNNING:
                return True
            if self.state is DaemonState.FAILED or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; checked by pid + start time."""
        identity, self._identity = self._identity, None
        self.state = DaemonState.STOPPED
        self._forget_record()
        if identity is None or not self._procfs.is_alive(identity):
            self._reap()
            return
        _kill(identity.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and self._procfs.is_alive(identity):
            self._reap()
            time.sleep(0.02)
        if self._procfs.is_alive(identity):
            _kill(identity.pid, signal.SIGKILL)
        self._reap()
        log.info("GPU %d: MPS control daemon pid %d stopped", self.gpu, identity.pid)

    def adopt_recorded(self) -> bool:
        """At agent start: take over the daemon a previous agent recorded, if it still runs."""
        if self._identity is not None:
            return True
        self._identity = self._adopt()
        return self._identity is not None

    def stop_recorded(self) -> bool:
        """Stop the daemon its record names, if it still runs (a tear-down's clean-up)."""
        self._identity = self._adopt()
        if self._identity is None:
            return False
        self.stop()
        return True

    def _start(self) -> None:
        """Start the daemon; MpsUnavailableError when it cannot be (its directories cannot
        be made, the command cannot run, its record cannot be written)."""
        try:
            for d in (self.pipe_dir, self.log_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._clean_pipe_dir()
            (self.pipe_dir / "control").unlink(missing_ok=True)  # a dead daemon's socket
        except OSError as err:
            self.error = f"cannot prepare its directories under {self.home}: {err.strerror or err}"
            log.error("GPU %d: no MPS: %s", self.gpu, self.error)
            raise MpsUnavailableError(self.error) from err
        self._socket_id = None
        env = {
            **self._environ,
            "CUDA_VISIBLE_DEVICES": self.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }
        try:
            with (self.log_dir / "daemon.out").open("ab") as out:
                child = subprocess.Popen(
                    self._command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        except OSError as err:
            self.state = DaemonState.FAILED
            self.error = f"cannot run {self._command[0]}: {err.strerror or err}"
            log.error("GPU %d: no MPS: %s", self.gpu, self.error)
            raise MpsUnavailableError(self.error) from err
        try:
            identity = self._procfs.identity(child.pid)
        except (PlatformError, ProcessGoneError):
            identity = ProcessIdentity(child.pid, 0)
        record = json.dumps({"pid": child.pid, "start_ticks": identity.start_ticks}).encode()
        try:
            write_atomic(self._record, record)
        except PlatformError as err:
            # Unrecorded, the next agent could not adopt it and would start a second one.
            child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STOP_WAIT_S)
            self.error = f"cannot record it: {err}"
            log.error("GPU %d: no MPS: %s", self.gpu, self.error)
            raise MpsUnavailableError(self.error) from err
        self._child, self._identity = child, identity
        self.state = DaemonState.STARTING
        log.info(
            "GPU %d: started MPS control daemon pid %d: %s", self.gpu, child.pid, " ".join(self._command)
        )

    def _clean_pipe_dir(self) -> None:
        """Remove links and strange entries before the daemon writes there (see above)."""
        for entry in self.pipe_dir.iterdir():
            try:
                mode = entry.lstat().st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) or stat.S_ISREG(mode):
                continue
            log.warning(
                "GPU %d: removing %s from the MPS pipe directory before the daemon starts", self.gpu, entry
            )
            if stat.S_ISDIR(mode):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _died(self, now: float) -> None:
        self._reap()
        code, self._exit_code = self._exit_code, None
        self._identity = None
        self._forget_record()
        self.error = f"exited{'' if code is None else f' with {code}'}: {self._tail()}".rstrip(": ")
        self._early_deaths = self._early_deaths + 1 if self.state is DaemonState.STARTING else 0
        if self._early_deaths >= GIVE_UP_AFTER:
            self.state = DaemonState.FAILED
            self.error = (
                f"died {self._early_deaths} times before its control socket came up, last {self.error}"
            )
            log.error("GPU %d: no MPS: the control daemon %s", self.gpu, self.error)
            return
        self.restarts += 1
        self.state = DaemonState.RESTARTING
        self._retry_at = now + self._backoff
        log.warning(
            "GPU %d: MPS control daemon %s; restarting in %.0f s", self.gpu, self.error, self._backoff
        )
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)

    def _alive(self) -> bool:
        assert self._identity is not None
        self._reap()
        return self._procfs.is_alive(self._identity)

    def _adopt(self) -> ProcessIdentity | None:
        try:
            raw = json.loads(self._record.read_text())
            identity = ProcessIdentity(int(raw["pid"]), int(raw["start_ticks"]))
        except _BAD_RECORD:
            return None
        if not self._procfs.is_alive(identity):
            self._forget_record()
            return None
        log.info(
            "GPU %d: adopted the MPS control daemon pid %d a previous agent started", self.gpu, identity.pid
        )
        self.state = DaemonState.STARTING
        return identity

    def _forget_record(self) -> None:
        """Remove daemon.json; one that cannot be removed names a daemon no longer running
        (adoption checks its pid and start time), so it is logged, not raised."""
        try:
            remove(self._record)
        except PlatformError as err:
            log.warning("GPU %d: %s", self.gpu, err)

    def _reap(self) -> int | None:
        if self._child is None:
            return None
        code = self._child.poll()
        if code is not None:
            self._child, self._exit_code = None, code
        return code

    def _tail(self) -> str:
        try:
            lines = (self.log_dir / "daemon.out").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""


def _kill(pid: int, signum: int) -> None:
    """Signal the daemon (a pid checked by start time just before); gone already is fine."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return
    except OSError as err:
        why = f"cannot signal the MPS control daemon pid {pid}: {err.strerror or err}"
        raise MpsCommandError(why) from err


def _socket_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the socket at ``path``; None when there is no socket there."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def stop_recorded_daemons(root: Path, procfs: ProcFS | None = None) -> int:
    """Stop every daemon recorded under ``root`` (pid + start time checked); how many. For
    tear-downs: the agent itself leaves its daemons running across restarts."""
    stopped = 0
    for record in sorted(root.glob("*/daemon.json")):
        if MpsDaemon(-1, record.parent.name, [], root, procfs=procfs).stop_recorded():
            stopped += 1
    return stopped
