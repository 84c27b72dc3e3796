"""Thread-CPU time per function in the agent process, for ``bench/footprint.py --parts``.

Put on ``PYTHONPATH`` with ``VCUDA_PARTS`` (comma-separated ``module:Class.method`` or
``module:function``) and ``VCUDA_PARTS_OUT`` (a file) set: in a ``python -m agent run``
process, each named function is wrapped to add up the thread CPU time
(``time.thread_time``) its calls take, and the totals are written to the file at exit.
A sampling profiler counts a thread that waits for a CPU after its timer fired as busy
(on a loaded 2-core VM most of the enforcer's samples were such waits); thread CPU time
counts only what ran. Each call costs two clock reads (about 1-2 us) more. SIGUSR1 starts
the window again (totals back to zero); SIGUSR2 writes the file (as the exit does). Every
other process ignores this file.
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any


def _wrap(spent: collections.defaultdict[str, float], calls: collections.Counter[str], target: str) -> None:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[path] += time.thread_time() - started
            calls[path] += 1

    setattr(owner, name, timed)


def _install() -> None:
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    out = os.environ["VCUDA_PARTS_OUT"]
    started = [time.monotonic()]
    for target in filter(None, os.environ.get("VCUDA_PARTS", "").split(",")):
        _wrap(spent, calls, target.strip())

    def restart(*_: object) -> None:
        spent.clear()
        calls.clear()
        started[0] = time.monotonic()

    def write(*_: object) -> None:
        elapsed = max(1e-9, time.monotonic() - started[0])
        with open(out + ".part", "w") as f:
            for path, seconds in sorted(spent.items(), key=lambda item: -item[1]):
                f.write(f"{path} {1000 * seconds / elapsed:.3f} {calls[path] / elapsed:.2f}\n")
        os.replace(out + ".part", out)

    signal.signal(signal.SIGUSR1, restart)
    signal.signal(signal.SIGUSR2, write)
    atexit.register(write)


if sys.argv[:2] == ["-m", "run"] and os.environ.get("VCUDA_PARTS_OUT"):
    _install()
