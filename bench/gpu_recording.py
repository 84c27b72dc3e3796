"""The recording machinery of bench/gpu_suite.py's traces: the trace file, the schedules the
suite imposes with the freezer, and the thread that reads NVML and the workers' progress.

Trace file (``trace-<pattern>.jsonl.gz``, gzip JSON lines, schema 1; bench/gpu_replay.py reads
it). The first record is the one ``meta``; the others follow in the order they were written
(an ``act`` of a freeze is written once its ``frozen_w`` is known, a ``segment`` at its end):

    {"t":"meta","pattern":str,"gpu":str,"driver":str,"workers":{"A":pid,"B":pid},
     "alone_steps_per_s":float|null,"sample_calls_s":0.1,"schema":1,"simulated":bool}
    {"t":"segment","name":str,"start":wall_s,"end":wall_s,
     "plan":{"A":{"duty":float,"cycle_s":float,"offset_s":float}|"free"|"frozen","B":...}}
    {"t":"act","w":wall_s,"who":"A"|"B","op":"freeze"|"thaw","frozen_w":wall_s|null}
    {"t":"proc","w":wall_s,"since":int_us,"samples":[[pid,ts_us,sm,mem],...]}
    {"t":"dev","w":wall_s,"since":int_us,"samples":[[ts_us,util],...]}
    {"t":"util","w":wall_s,"gpu":int,"mem":int|null}
    {"t":"steps","who":"A"|"B","w":[wall_s,...]}
    {"t":"end","w":wall_s}

- ``act.w``: the wall time just before the write to ``cgroup.freeze``; ``frozen_w``: when
  ``cgroup.events`` first read ``frozen 1`` (polled every 1 ms, up to 1 s; null: not seen in
  that second, or thawed again before; always null for a thaw).
- ``proc``/``dev``/``util``: ``w`` is the wall time just before the call. Every 0.1 s one
  ``nvmlDeviceGetProcessUtilization`` with ``since`` = the newest timestamp the previous such
  calls returned (0 at first): the agent's way of reading. Every 1.0 s one more with
  ``since`` = ``round(w * 1e6) - 2_000_000`` exactly (how a reader tells the two apart): its
  two seconds overlap earlier calls, so whether the same entries come back (one per process
  per driver sample) or new ones (one per process per call) settles how NVML aggregates.
  Its answers do not move the incremental ``since``. NOT_FOUND is an empty ``samples``;
  other errors are counted in summary.json, not written as records.
- ``mem``: null where the source has none (the simulated GPU).
- ``steps``: batches of step completion times read from the workers' progress files.

NVML's per-process samples credit the ONE process resident on the engine at each sample
instant (docs/reference.md, "The driver's samples"), and NVML's own aggregation into
``smUtil`` is closed source. These records are raw so that how NVML aggregates, and what the
driver does under freezing (how long a freeze takes to land, how much queued work runs after
it), can be settled from them.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_sources import Source
from gpu_workers import FROZEN_POLL_S, FROZEN_WAIT_S, Freezer, ProgressTail

SCHEMA = 1
SAMPLE_S = 0.1
OVERLAP_EVERY = 10  # sampler ticks: one overlapping call a second
OVERLAP_US = 2_000_000
STEPS_EVERY = 2  # sampler ticks: the progress files are read every 0.2 s


@dataclass(frozen=True)
class Slot:
    """Thawed for ``duty`` of each ``cycle_s``, from ``offset_s`` into the cycle."""

    duty: float
    cycle_s: float
    offset_s: float = 0.0


Plan = Slot | str  # or "free" (thawed throughout) or "frozen"


def plan_json(plan: dict[str, Plan]) -> dict[str, Any]:
    return {
        who: p if isinstance(p, str) else {"duty": p.duty, "cycle_s": p.cycle_s, "offset_s": p.offset_s}
        for who, p in plan.items()
    }


def thawed_at(plan: Plan, t: float) -> bool:
    """Whether ``plan`` has its worker thawed ``t`` seconds into the segment."""
    if isinstance(plan, str):
        return plan == "free"
    return (t - plan.offset_s) % plan.cycle_s < plan.duty * plan.cycle_s


def next_edge(plan: Plan, t: float) -> float:
    """The first time after ``t`` at which ``plan`` changes its worker's state."""
    if isinstance(plan, str):
        return math.inf
    phase = (t - plan.offset_s) % plan.cycle_s
    on = plan.duty * plan.cycle_s
    return t + (on - phase if phase < on else plan.cycle_s - phase)


class TraceWriter:
    """Records kept in memory and appended to ``<name>.partial.jsonl`` as they come (what a
    run killed outright leaves); ``close`` writes the gzip file, the final meta first, and
    removes the partial file."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.partial = path.with_name(path.name.removesuffix(".jsonl.gz") + ".partial.jsonl")
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._flushed = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.partial.open("w")
        self._write_line(meta)

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.append(record)
            self._write_line(record)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)

    def _write_line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        if time.monotonic() - self._flushed > 1.0:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self, meta: dict[str, Any]) -> None:
        with self._lock:
            self._file.close()
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with gzip.open(tmp, "wt") as out:
                for record in [meta, *self._records]:
                    out.write(json.dumps(record, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
            self.partial.unlink(missing_ok=True)


class Scheduler:
    """Imposes plans with the freezer and writes every act."""

    def __init__(self, freezer: Freezer, writer: TraceWriter, whos: tuple[str, ...]) -> None:
        self.freezer = freezer
        self.writer = writer
        self.frozen: dict[str, bool | None] = dict.fromkeys(whos)
        self._pending: dict[str, tuple[float, float]] = {}  # who -> (act wall, monotonic deadline)
        self.freeze_delays: list[float] = []

    def apply(self, who: str, frozen: bool) -> None:
        if self.frozen[who] is frozen:
            return
        if not frozen and who in self._pending:
            self._resolve(who, None)  # thawed again before the freeze was seen to land
        w = time.time()
        self.freezer.set(who, frozen)
        self.frozen[who] = frozen
        if frozen:
            self._pending[who] = (w, time.monotonic() + FROZEN_WAIT_S)
        else:
            self.writer.add({"t": "act", "w": w, "who": who, "op": "thaw", "frozen_w": None})

    def poll(self) -> None:
        for who, (_w, deadline) in list(self._pending.items()):
            if self.freezer.is_frozen(who):
                self._resolve(who, time.time())
            elif time.monotonic() > deadline:
                self._resolve(who, None)

    def _resolve(self, who: str, frozen_w: float | None) -> None:
        w, _deadline = self._pending.pop(who)
        if frozen_w is not None:
            self.freeze_delays.append(frozen_w - w)
        self.writer.add({"t": "act", "w": w, "who": who, "op": "freeze", "frozen_w": frozen_w})

    def hold(self, plan: dict[str, Plan], seconds: float) -> tuple[float, float]:
        """Keep ``plan`` for ``seconds``; (start, end) wall times."""
        start_m, start_w = time.monotonic(), time.time()
        end_m = start_m + seconds
        while (now := time.monotonic()) < end_m:
            t = now - start_m
            for who, p in plan.items():
                self.apply(who, not thawed_at(p, t))
            self.poll()
            wake = min(end_m, start_m + min(next_edge(p, t) for p in plan.values()))
            if self._pending:
                wake = min(wake, now + FROZEN_POLL_S)
            time.sleep(max(0.0, wake - time.monotonic()))
        return start_w, time.time()

    def settle(self) -> None:
        """Wait out the freezes not yet seen to land (at most FROZEN_WAIT_S)."""
        while self._pending:
            self.poll()
            time.sleep(FROZEN_POLL_S)


class Sampler(threading.Thread):
    """Every SAMPLE_S: NVML's per-process samples (incremental; and overlapping every second),
    its device samples and utilization; every 0.2 s the workers' new steps."""

    def __init__(self, source: Source, writer: TraceWriter, tails: dict[str, ProgressTail]) -> None:
        super().__init__(name="sampler", daemon=True)
        self.source = source
        self.writer = writer
        self.tails = tails
        self.steps: dict[str, list[float]] = {who: [] for who in tails}
        self.errors: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()
        self._since_proc = 0
        self._since_dev = 0

    def run(self) -> None:
        start, tick = time.monotonic(), 0
        while not self.stop.wait(max(0.0, start + tick * SAMPLE_S - time.monotonic())):
            self._tick(tick)
            # A slow call (a busy driver) skips ticks rather than bunching them up.
            tick = max(tick + 1, int((time.monotonic() - start) / SAMPLE_S))

    def _tick(self, tick: int) -> None:
        since = self._since_proc
        got = self._call("nvmlDeviceGetProcessUtilization", self.source.proc, since)
        if got is not None:
            w, samples = got
            self.writer.add({"t": "proc", "w": w, "since": since, "samples": samples})
            self._since_proc = max([since, *(int(s[1]) for s in samples)])
        if tick % OVERLAP_EVERY == 0:
            w = time.time()
            since = round(w * 1e6) - OVERLAP_US
            got = self._call("nvmlDeviceGetProcessUtilization (overlapping)", self.source.proc, since, w)
            if got is not None:
                self.writer.add({"t": "proc", "w": w, "since": since, "samples": got[1]})
        since = self._since_dev
        got = self._call("nvmlDeviceGetSamples", self.source.dev, since)
        if got is not None:
            w, samples = got
            self.writer.add({"t": "dev", "w": w, "since": since, "samples": samples})
            self._since_dev = max([since, *(int(s[0]) for s in samples)])
        util = self._call("nvmlDeviceGetUtilizationRates", lambda _: self.source.util(), 0)
        if util is not None:
            self.writer.add({"t": "util", "w": util[0], "gpu": util[1][0], "mem": util[1][1]})
        if tick % STEPS_EVERY == 0:
            self.read_steps()

    def _call(
        self, name: str, fn: Callable[[int], Any], since: int, w: float | None = None
    ) -> tuple[float, Any] | None:
        w = time.time() if w is None else w
        try:
            return w, fn(since)
        except Exception as err:  # noqa: BLE001  (counted in summary.json; sampling goes on)
            seen = self.errors.setdefault(name, {"count": 0, "first": f"{type(err).__name__}: {err}"})
            seen["count"] += 1
            return None

    def read_steps(self) -> None:
        for who, tail in self.tails.items():
            new = tail.read()
            if new:
                self.steps[who].extend(new)
                self.writer.add({"t": "steps", "who": who, "w": new})
