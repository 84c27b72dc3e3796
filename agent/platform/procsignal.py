"""Signalling exactly one process: pid + start time, checked through a pidfd.

A pid alone can be reused between the moment it was read and the signal. A pidfd is
opened first: it pins the process that had the pid at that moment, so after its start
time matches the recorded one, the signal can only reach that process (or fail with
ESRCH once it has exited). Without pidfd support (kernels before 5.3) the check is made
right before ``kill`` and a tiny window remains.
"""

from __future__ import annotations

import enum
import errno
import os
import signal

from agent.errors import PlatformError, ProcessGoneError
from agent.platform.procfs import ProcessIdentity, ProcFS


class SignalError(PlatformError):
    """A signal could not be delivered to a process that still exists (e.g. EPERM)."""


class SignalOutcome(enum.Enum):
    SENT = "sent"
    GONE = "gone"  # exited (or a zombie): nothing to signal
    REUSED = "reused"  # the pid now belongs to another process: not signalled
    REFUSED = "refused"  # pid <= 1 or this process itself: never signalled


def signal_identity(identity: ProcessIdentity, signum: int, procfs: ProcFS | None = None) -> SignalOutcome:
    """Send ``signum`` to ``identity`` only if its pid still runs that same process."""
    pid = identity.pid
    if pid <= 1 or pid == os.getpid():
        return SignalOutcome.REFUSED
    procfs = procfs or ProcFS()
    pidfd = _pidfd_open(pid)
    if pidfd == -errno.ESRCH:
        return SignalOutcome.GONE
    try:
        try:
            stat = procfs.stat(pid)
        except ProcessGoneError:
            return SignalOutcome.GONE
        if stat.start_ticks != identity.start_ticks:
            return SignalOutcome.REUSED
        if stat.state in ("Z", "X"):
            return SignalOutcome.GONE
        try:
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            return SignalOutcome.GONE
        except OSError as err:
            raise SignalError(f"cannot send {_name(signum)} to pid {pid}: {err.strerror or err}") from err
        return SignalOutcome.SENT
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _pidfd_open(pid: int) -> int:
    """A pidfd, -ESRCH when the process is gone, -1 when this kernel has no pidfd_open."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -errno.ESRCH
    except OSError as err:
        if err.errno in (errno.ENOSYS, errno.EINVAL):
            return -1
        raise SignalError(f"cannot open a pidfd for pid {pid}: {err.strerror or err}") from err


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
