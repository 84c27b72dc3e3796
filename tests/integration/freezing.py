"""Helpers for the freezer and watchdog tests: busy children, CPU ticks, thawing before cleanup.

A v1-frozen process cannot die until it is thawed, so every test tree is thawed (and its
children continued) before ``cgroup_tree`` kills the children and removes the dirs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.platform.cgroups.freezer import freezer_file, set_frozen
from agent.platform.procfs import ProcFS
from tests.integration.cgroup_trees import CgroupTree, cgroup_tree

PROCFS = ProcFS()

# An agent as a real child process: a journal, the watchdog, one cgroup frozen through the
# FreezerActuator; prints the watchdog's pid (and a forked child's) and waits to be killed.
AGENT_SCRIPT = """
import os, sys, time
from pathlib import Path
from agent.control.actuators import FreezerActuator, ThrottleTarget
from agent.platform.freezejournal import FreezeJournal
from agent.platform import watchdog as watchdog_module
from agent.platform.watchdog import spawn_watchdog

journal_path, cgroup = Path(sys.argv[1]), Path(sys.argv[2])
journal = FreezeJournal(journal_path)
watchdog = spawn_watchdog(journal_path)
FreezerActuator(journal).freeze(ThrottleTarget("ns/pod/ctr", cgroup, None))
forked = 0
if sys.argv[3:] == ["fork"]:  # a child forked without exec outlives the agent
    forked = os.fork()
    if forked == 0:
        time.sleep(60)
        os._exit(0)
print(watchdog.pid, forked, flush=True)
time.sleep(600)
"""


@contextmanager
def thawing_tree() -> Iterator[CgroupTree]:
    """``cgroup_tree()`` whose dirs are thawed and children continued before its cleanup."""
    with cgroup_tree() as tree:
        try:
            yield tree
        finally:
            for path in tree.created:
                if path.is_dir() and freezer_file(path) is not None:
                    set_frozen(path, False)
            for child in tree.children:
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGCONT)


def busy_child(tree: CgroupTree, cgroup_dir: Path | None = None) -> subprocess.Popen[str]:
    """A process spinning on a CPU (in ``cgroup_dir`` if given), killed by the tree's cleanup."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"], text=True)
    tree.children.append(child)
    if cgroup_dir is not None:
        (cgroup_dir / "cgroup.procs").write_text(str(child.pid))
    return child


def ticks(pid: int) -> int:
    return PROCFS.stat(pid).cpu_ticks


def state(pid: int) -> str:
    return PROCFS.stat(pid).state


def wait_for(condition: Callable[[], bool], timeout_s: float = 2.0, step_s: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)


def advances(pid: int, timeout_s: float = 2.0) -> bool:
    """Whether the process gets CPU time within ``timeout_s``."""
    start = ticks(pid)
    return wait_for(lambda: ticks(pid) > start, timeout_s)


def stalled(pid: int, over_s: float = 0.3) -> bool:
    """Whether the process gets no CPU time at all over ``over_s``, once the freeze has taken
    hold: the v2 freezer completes asynchronously, and a busy process may still be charged a
    tick or two right after the write (seen on a loaded CI machine)."""
    settle_until = time.monotonic() + 1.0
    last = ticks(pid)
    while time.monotonic() < settle_until:
        time.sleep(0.05)
        now = ticks(pid)
        if now == last:
            break
        last = now
    start = ticks(pid)
    time.sleep(over_s)
    return ticks(pid) == start
