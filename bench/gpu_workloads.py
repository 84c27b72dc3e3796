"""The PyTorch worker programs of bench/gpu_suite.py: one CUDA loop per process, each
appending the wall time of every completed step to a progress file, so that what it got of
the GPU is read from its own throughput rather than from NVML.

Patterns (the shapes of work the freezer meets: docs/reference.md, "How a GPU executes work"):

- ``train``: one 4096x4096 fp32 matmul, then ``torch.cuda.synchronize()``; a step each;
- ``infer``: requests of 4 matmuls of 2048x2048 and a sync, back to back; a request each;
- ``burn``: a queue kept full of 8192x8192 matmuls (``out=`` so nothing is allocated),
  never synced: a launch blocks while CUDA's launch queue is full, so the marks (one per
  16 launches) follow what the GPU completes; frozen, the queue keeps draining;
- ``graph``: a CUDA graph of 50 matmuls of 2048x2048 replayed, a sync per replay.

    python3 bench/gpu_workloads.py PATTERN PROGRESS_FILE [--ready FILE] [--go FILE]
        [--device cuda|cpu] [--seconds S]

Start-up (CUDA init, cuBLAS's first call, the graph's capture) happens before the
``--ready`` file is written; with ``--go`` the loop waits for that file, so a worker the
suite keeps frozen submits nothing until its first segment. The progress file gets batches
of text lines (``%.6f`` wall seconds), appended at least every 0.2 s while the process runs,
and the rest at SIGTERM/SIGINT. ``--device cpu`` runs the same programs on the CPU at 1/8 of
the sizes (no graph capture) to check them where there is no GPU.

Standard library and PyTorch only: it runs on a GPU machine without this project installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PATTERNS = ("train", "infer", "burn", "graph")
FLUSH_S = 0.1  # well inside the suite's 0.2 s: the reader sees steps while they are fresh
BURN_MARK_EVERY = 16  # launches per progress mark in burn
GRAPH_KERNELS = 50
CPU_SCALE = 8  # --device cpu divides every matrix size by this


class Marks:
    """Step completion times, appended to the progress file in batches by a flusher thread
    (a step loop blocked in the driver, or frozen, must not hold the batch back longer than
    it is itself held)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pending: list[float] = []
        # Reentrant: the SIGTERM handler flushes in the main thread, which may hold it in mark().
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marks", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        now = time.time()
        with self._lock:
            self._pending.append(now)

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            os.write(self._fd, "".join(f"{t:.6f}\n" for t in batch).encode())

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()


def _step_fn(torch: Any, pattern: str, device: str) -> Callable[[], None]:
    """Warm the pattern up (allocations, cuBLAS, graph capture) and return one step."""
    cuda = device == "cuda"
    scale = 1 if cuda else CPU_SCALE

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def square(n: int) -> Any:
        return torch.randn(n // scale, n // scale, device=device)

    if pattern == "train":
        a, b = square(4096), square(4096)

        def train() -> None:
            _c = a @ b
            sync()

        step = train
    elif pattern == "infer":
        a, b = square(2048), square(2048)

        def infer() -> None:
            for _ in range(4):
                _c = a @ b
            sync()

        step = infer
    elif pattern == "burn":
        a, b, c = square(8192), square(8192), square(8192)

        def burn() -> None:
            for _ in range(BURN_MARK_EVERY):
                torch.matmul(a, b, out=c)

        step = burn
    else:
        step = _graph_step(torch, device, square, sync)
    for _ in range(3):  # cuBLAS picks its kernels and allocates its workspace here
        step()
    sync()
    return step


def _graph_step(
    torch: Any, device: str, square: Callable[[int], Any], sync: Callable[[], None]
) -> Callable[[], None]:
    a, b, c = square(2048), square(2048), square(2048)
    if device != "cuda":  # no graphs on the CPU: the same matmuls, launched one by one

        def loop() -> None:
            for _ in range(GRAPH_KERNELS):
                torch.matmul(a, b, out=c)

        return loop
    # Warm up on a side stream before capture, as PyTorch's CUDA graph docs require.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.matmul(a, b, out=c)
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_KERNELS):
            torch.matmul(a, b, out=c)

    def replay() -> None:
        graph.replay()
        sync()

    return replay


def run(
    pattern: str, progress: Path, *, ready: Path | None, go: Path | None, device: str, seconds: float | None
) -> int:
    torch: Any = importlib.import_module("torch")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_workloads: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    step = _step_fn(torch, pattern, device)
    marks = Marks(progress)

    def on_signal(_signum: int, _frame: object) -> None:
        marks.close()  # the last batch too: the suite reads the file after the worker exits
        os._exit(0)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if ready is not None:
        ready.write_text(f"{os.getpid()}\n")
    while go is not None and not go.exists():
        time.sleep(0.005)
    end = None if seconds is None else time.monotonic() + seconds
    try:
        while end is None or time.monotonic() < end:
            step()
            marks.mark()
    finally:
        marks.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("pattern", choices=PATTERNS)
    parser.add_argument("progress", type=Path, help="file the step completion times are appended to")
    parser.add_argument("--ready", type=Path, help="written once warmed up (default PROGRESS.ready)")
    parser.add_argument("--go", type=Path, help="wait for this file to exist before the loop")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, help="stop after this long (default: until signalled)")
    args = parser.parse_args(argv)
    ready = args.ready or args.progress.with_name(args.progress.name + ".ready")
    return run(args.pattern, args.progress, ready=ready, go=args.go, device=args.device, seconds=args.seconds)


if __name__ == "__main__":
    raise SystemExit(main())
