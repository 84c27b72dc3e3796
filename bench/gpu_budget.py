"""Time and bookkeeping of bench/gpu_suite.py: a wall-clock budget that every stage, pattern
and scenario asks before it starts, and ``summary.json``, rewritten after every change, so
that a run cut short (by the budget, a failure or the machine going away) still says what
it wrote, what it skipped and why, and what failed.

A GPU machine is lent for minutes and once: a part that would overrun is skipped and listed,
never started; an exception in one part is recorded and the next part runs.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

RESERVE_S = 15.0  # kept back for the last clean-up (thaw, kill, remove cgroups) and summary


class Interrupted(BaseException):  # a signal, not an error: BaseException like KeyboardInterrupt
    """SIGTERM or SIGINT arrived: unwind through every ``finally`` (thaw, kill, clean up)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class Budget:
    """Seconds left of ``total_s``, less a reserve for the clean-up at the end."""

    def __init__(
        self, total_s: float, *, reserve_s: float = RESERVE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_s = total_s
        self.reserve_s = reserve_s
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def left(self) -> float:
        """Seconds a part may still take (negative: already over)."""
        return self.total_s - self.reserve_s - self.elapsed()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()

    def say(self, message: str) -> None:
        """A progress line, stamped with the seconds since the start."""
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)


class Summary:
    """``summary.json``: files written, parts skipped (and why), errors, per-stage notes and
    the RESULT figures; written atomically after every change."""

    def __init__(self, path: Path, args: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {
            "started_w": time.time(),
            "args": args,
            "files": [],
            "skipped": [],
            "errors": [],
            "stages": {},
            "result": {},
            "finished": False,
        }
        self.write()

    def file(self, path: Path) -> None:
        if str(path) not in self.doc["files"]:
            self.doc["files"].append(str(path))
        self.write()

    def skip(self, part: str, why: str) -> None:
        self.doc["skipped"].append({"part": part, "why": why})
        self.write()

    def error(self, part: str, err: BaseException) -> None:
        self.doc["errors"].append(
            {
                "part": part,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exception(err)[-6:],
            }
        )
        self.write()

    def stage(self, name: str, **info: Any) -> None:
        self.doc["stages"].setdefault(name, {}).update(info)
        self.write()

    def result(self, **figures: Any) -> None:
        self.doc["result"].update(figures)
        self.write()

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
            os.replace(tmp, self.path)
        except OSError as err:  # the summary must never be what stops a run
            print(f"gpu_suite: cannot write {self.path}: {err}", flush=True)


def attempt(part: str, estimate_s: float, budget: Budget, summary: Summary, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` if about ``estimate_s`` fits the budget (else list it as skipped); an
    exception is recorded and None returned, so the next part runs. Interrupted goes on up."""
    if not budget.fits(estimate_s):
        why = f"needs about {estimate_s:.0f} s, {max(budget.left(), 0):.0f} s of the budget left"
        budget.say(f"{part}: skipped ({why})")
        summary.skip(part, why)
        return None
    try:
        return fn()
    except Exception as err:  # noqa: BLE001  (recorded in summary.json; the next part runs)
        budget.say(f"{part}: FAILED: {type(err).__name__}: {err}")
        summary.error(part, err)
        return None
