"""The worker processes of bench/gpu_suite.py's traces, each in a cgroup v2 directory of its
own under a private parent (``<v2 root>/vcuda-gpu-suite-<pid>/A``), and the freezer that
holds them: writes to ``cgroup.freeze``, with the moment ``cgroup.events`` first says
``frozen 1`` (a task inside a driver call freezes only when it leaves it: that delay is data).

Where no cgroup v2 directory can be made, SIGSTOP/SIGCONT stand in (the process stops as a
whole all the same; "frozen" is then its state ``T`` in /proc) and the summary says so.

A worker joins its cgroup before it execs (a shell writes its pid to ``cgroup.procs`` and
execs the program), so it never runs a moment outside it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

FROZEN_POLL_S = 0.001
FROZEN_WAIT_S = 1.0


class Freezer(Protocol):
    kind: str

    def set(self, who: str, frozen: bool) -> None: ...

    def is_frozen(self, who: str) -> bool: ...


@dataclass
class CgroupFreezer:
    """``cgroup.freeze`` of each worker's own directory."""

    dirs: dict[str, Path]
    kind: str = "cgroup.freeze"

    def set(self, who: str, frozen: bool) -> None:
        (self.dirs[who] / "cgroup.freeze").write_text("1" if frozen else "0")

    def is_frozen(self, who: str) -> bool:
        events = (self.dirs[who] / "cgroup.events").read_text()
        return "frozen 1" in events.splitlines()


@dataclass
class SignalFreezer:
    """SIGSTOP/SIGCONT, where no cgroup could be made."""

    pids: dict[str, int]
    kind: str = "SIGSTOP/SIGCONT (no cgroup v2 directory could be made)"

    def set(self, who: str, frozen: bool) -> None:
        os.kill(self.pids[who], signal.SIGSTOP if frozen else signal.SIGCONT)

    def is_frozen(self, who: str) -> bool:
        stat = Path(f"/proc/{self.pids[who]}/stat").read_text()
        return stat[stat.rindex(")") + 2] == "T"


@dataclass
class CgroupParent:
    """``<v2 root>/vcuda-gpu-suite-<pid>`` and its children; ``remove`` takes them all away."""

    path: Path
    made: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, v2_root: Path) -> CgroupParent:
        path = v2_root / f"vcuda-gpu-suite-{os.getpid()}"
        path.mkdir()
        return cls(path, [path])

    def child(self, name: str) -> Path:
        path = self.path / name
        path.mkdir()
        self.made.append(path)
        return path

    def remove(self) -> list[str]:
        """rmdir every directory made, children first, each retried for 5 s (an exiting process
        leaves its cgroup a moment after wait()); what could not be removed."""
        left = []
        for path in reversed(self.made):
            deadline = time.monotonic() + 5.0
            while path.exists():
                try:
                    path.rmdir()
                except OSError as err:
                    if time.monotonic() > deadline:
                        left.append(f"{path}: {err}")
                        break
                    time.sleep(0.05)
        self.made.clear()
        return left


@dataclass
class ProgressTail:
    """New step times appended to a progress file since the last read (whole lines only)."""

    path: Path
    _offset: int = 0

    def read(self) -> list[float]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].split():
            with contextlib.suppress(ValueError):
                out.append(float(line))
        return out


@dataclass
class Worker:
    who: str
    proc: subprocess.Popen[bytes]
    progress: Path
    ready_file: Path | None  # None: ready once it made progress (the simulated workloads)
    log: Path
    cgroup: Path | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> bool:
        if self.ready_file is not None:
            return self.ready_file.exists()
        try:
            return self.progress.stat().st_size > 0
        except FileNotFoundError:
            return False

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_worker(
    who: str,
    command: Sequence[str],
    *,
    workdir: Path,
    cgroup: Path | None,
    env: dict[str, str],
    ready_file: Path | None,
    progress: Path,
) -> Worker:
    log = workdir / f"worker-{who}.log"
    cmd = list(command)
    if cgroup is not None:  # join, then exec: the same pid, inside from its first instruction
        cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *cmd]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Worker(who, proc, progress, ready_file, log, cgroup)


def wait_ready(workers: Sequence[Worker], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(
                    f"worker {w.who} exited with {w.proc.returncode} before it was ready: {w.log_tail()}"
                )
        if all(w.ready() for w in workers):
            return
        if time.monotonic() > deadline:
            late = [w.who for w in workers if not w.ready()]
            raise TimeoutError(f"workers {late} not ready within {timeout_s:.0f} s: {workers[0].log_tail()}")
        time.sleep(0.05)


def stop_workers(workers: Sequence[Worker], freezer: Freezer | None, grace_s: float = 3.0) -> None:
    """Thaw (a frozen process cannot act on a signal), SIGTERM (the PyTorch workers flush their
    last steps), SIGKILL whatever is left after ``grace_s``."""
    for w in workers:
        if freezer is not None:
            with contextlib.suppress(OSError):
                freezer.set(w.who, False)
        if w.proc.poll() is None:
            with contextlib.suppress(OSError):
                w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.kill(w.pid, signal.SIGCONT)
            w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=10)
        if w.cgroup is not None:  # anything the worker started is killed with it
            with contextlib.suppress(OSError):
                for pid in (w.cgroup / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
