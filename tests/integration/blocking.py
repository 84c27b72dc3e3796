"""How a thread is blocked, from /proc/<pid>/task/<tid>/syscall (the syscall and its
arguments while the thread sleeps in it): a wait with no timeout, which only an event can
end, tells apart from a timed one (a loop that looks at a flag every so often is always in
a timed one)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

FUTEX = {"x86_64": 202, "aarch64": 98}  # timeout: 4th argument, a pointer (0: none)
EPOLL_WAITS = {"x86_64": {232, 281}, "aarch64": {22}}  # timeout: 4th argument, ms (-1: none)
PSELECT6 = {"x86_64": 270, "aarch64": 72}  # timeout: 5th argument, a pointer (0: none)


def blocked_wait(tid: int, pid: int | None = None) -> bool | None:
    """True: blocked with no timeout; False: in a timed wait; None: neither (running, or in
    another syscall). ``pid``: the process (default this one)."""
    path = Path(f"/proc/{pid or os.getpid()}/task/{tid}/syscall")
    fields = path.read_text().split()
    if len(fields) < 6 or not fields[0].isdigit():
        return None
    number, machine = int(fields[0]), platform.machine()
    if number == FUTEX[machine]:
        return int(fields[4], 16) == 0
    if number in EPOLL_WAITS[machine]:
        return int(fields[4], 16) & 0xFFFFFFFF == 0xFFFFFFFF
    if number == PSELECT6[machine]:
        return int(fields[5], 16) == 0
    return None


def voluntary_switches(tid: int, pid: int | None = None) -> int:
    """The thread's sleeps so far (each one a wakeup)."""
    status = Path(f"/proc/{pid or os.getpid()}/task/{tid}/status").read_text()
    return next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:")
    )


def task_named(pid: int, name: str) -> int | None:
    """The tid of ``pid``'s thread whose kernel name is ``name`` (agent/platform/threadname.py)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                return int(task.name)
        except FileNotFoundError:
            continue  # ended while we looked
    return None
