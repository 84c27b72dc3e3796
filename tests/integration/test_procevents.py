"""The process cache on the real process connector, with real child processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.platform.procevents import ProcessCache, ProcessChange, ProcEventSource, ProcEventsUnavailable

pytestmark = pytest.mark.privileged  # cn_proc needs CAP_NET_ADMIN before Linux 6.6

MARKER = "VCUDA_PROCEVENTS_TEST"


def marker_of(pid: int) -> str | None:
    """The resolver the tests use: a marker in the process's environment (it survives exec)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None  # gone, or not ours to read
    for item in environ.split(b"\0"):
        if item.startswith(MARKER.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    return None


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``condition``; return the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - start


@pytest.fixture
def running_cache() -> Iterator[tuple[ProcessCache[str], list[ProcessChange[str]]]]:
    try:
        ProcEventSource().close()
    except ProcEventsUnavailable as err:
        pytest.skip(f"the process connector is unavailable here: {err}")
    cache: ProcessCache[str] = ProcessCache(marker_of)
    changes: list[ProcessChange[str]] = []
    cache.subscribe(changes.append)
    stop = threading.Event()
    thread = threading.Thread(target=cache.run, args=(stop,), name="procevents-test")
    thread.start()
    wait_for(lambda: cache.mode == "events" and cache.rescans >= 1, 10, "the cache following events")
    yield cache, changes
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive(), "run() did not honour stop"


def test_an_execed_process_appears_with_its_value_and_leaves_within_a_second_of_exit(
    running_cache: tuple[ProcessCache[str], list[ProcessChange[str]]],
) -> None:
    cache, changes = running_cache
    tag = uuid.uuid4().hex
    child = subprocess.Popen(
        ["/bin/sh", "-c", "read line; exec cat"],
        stdin=subprocess.PIPE,
        env={**os.environ, MARKER: tag},
    )
    try:
        wait_for(lambda: child.pid in cache.processes(), 2, f"child {child.pid} in the cache")
        assert cache.get(child.pid) == tag
        assert cache.processes()[child.pid].identity.pid == child.pid
        assert child.stdin is not None
        child.stdin.write(b"go\n")  # sh execs cat: still the same process, same value
        child.stdin.flush()
        child.stdin.close()  # cat reads EOF and exits
        assert child.wait(timeout=10) == 0
        took = wait_for(lambda: child.pid not in cache, 1.0, f"exited child {child.pid} leaving the cache")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    ours = [(c.started, c.value) for c in changes if c.identity.pid == child.pid]
    assert ours == [(True, tag), (False, tag)], ours
    assert took < 1.0


def test_thirty_processes_exiting_together_all_leave(
    running_cache: tuple[ProcessCache[str], list[ProcessChange[str]]],
) -> None:
    cache, changes = running_cache
    tag = uuid.uuid4().hex
    env = {**os.environ, MARKER: tag}
    procs = [
        subprocess.Popen(["/bin/sh", "-c", "read x || true"], stdin=subprocess.PIPE, env=env)
        for _ in range(30)
    ]
    pids = {p.pid for p in procs}
    try:
        wait_for(lambda: pids <= set(cache.processes()), 5, "30 processes in the cache")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            assert proc.wait(timeout=10) == 0
        wait_for(lambda: not pids & set(cache.processes()), 1.0, "30 exited processes leaving the cache")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    started = {c.identity.pid for c in changes if c.started and c.value == tag}
    gone = {c.identity.pid for c in changes if not c.started and c.value == tag}
    assert started == gone == pids


SCAN_MODE = r"""
import json, os, subprocess, sys, threading, time
from agent.platform.procevents import ProcessCache
from pathlib import Path

def resolve(pid):
    try:
        return "child" if b"VCUDA_SCAN_CHILD=1" in Path(f"/proc/{pid}/environ").read_bytes() else None
    except OSError:
        return None

cache = ProcessCache(resolve, fallback_interval_s=0.2)
stop = threading.Event()
thread = threading.Thread(target=cache.run, args=(stop,))
thread.start()
child = subprocess.Popen(["sleep", "30"], env={**os.environ, "VCUDA_SCAN_CHILD": "1"})
deadline = time.monotonic() + 5
while child.pid not in cache.processes() and time.monotonic() < deadline:
    time.sleep(0.01)
seen = child.pid in cache.processes()
child.kill(); child.wait()
gone_at = time.monotonic()
while child.pid in cache and time.monotonic() < gone_at + 5:
    time.sleep(0.01)
took = time.monotonic() - gone_at
mode = cache.mode
stop.set(); thread.join()
print(json.dumps({"mode": mode, "seen": seen, "took": took}))
"""


def test_outside_the_host_network_namespace_it_scans_proc() -> None:
    """cn_proc only works in the initial network namespace; a pod without hostNetwork scans /proc."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) to make a network namespace")
    out = subprocess.run(
        [unshare, "--net", sys.executable, "-c", SCAN_MODE], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "process events unavailable" in out.stderr
    assert result["mode"] == "scan" and result["seen"]
    assert result["took"] < 1.0  # the 0.2 s scan interval, with margin
