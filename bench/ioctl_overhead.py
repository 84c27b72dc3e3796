"""Cost per ioctl syscall with the ioctl tracer attached vs detached, measured in one run.

One loaded tracer is attached and detached in alternating blocks while a tight loop
issues ioctls on /dev/null: an NVIDIA-shaped one (RM_CONTROL, cmd 0xC020462A, 32-byte
buffer: the tracer's full path, per-thread state, per-(process, escape) stats, latency
histogram) and an ordinary one (TCGETS 0x5401: filtered out at entry, one lookup at exit).
In the same rounds, empty programs on the same two tracepoints give the floor, what the
kernel's tracepoint machinery costs on this machine before any of our code runs, and
getppid() shows what enabling syscall tracepoints costs unrelated syscalls. Conditions
rotate within each round so drift hits all alike. The loop is a tiny C function compiled
at run time when a C compiler exists, else ctypes (more noise, no bias).
Target: <= +150 ns per NVIDIA ioctl.

    sudo .venv/bin/python bench/ioctl_overhead.py [--rounds 20] [--calls 200000] [--no-cc]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.platform.bpf.ioctl_tracer import TRACEPOINT_ENTER, TRACEPOINT_EXIT, IoctlTracer
from agent.platform.bpf.nvioctl import NV_IOCTL_MAGIC, RM_CONTROL, iowr
from agent.platform.bpf.probe import probe_bpf

TCGETS = 0x5401
GETPPID = -1  # not an ioctl: the loop calls getppid() instead
LOOP_C = r"""
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
long long ioctl_loop(int fd, long cmd, long n, void *buf) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    if (cmd < 0)
        for (long i = 0; i < n; i++)
            syscall(SYS_getppid);
    else
        for (long i = 0; i < n; i++)
            ioctl(fd, (unsigned long)cmd, buf);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
}
"""
FLOOR_C = """
int vcuda_ioctl_enter(void *ctx) { return 0; }
int vcuda_ioctl_exit(void *ctx) { return 0; }
"""
CMDS = {"nv": RM_CONTROL, "other": TCGETS, "getppid": GETPPID}
Loop = Callable[[int, int, int], int]  # (fd, cmd, calls) -> elapsed ns


def c_loop(workdir: Path) -> Loop | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = workdir / "loop.c", workdir / "loop.so"
    source.write_text(LOOP_C)
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)])
    if built.returncode != 0:
        return None
    lib = ctypes.CDLL(str(library))
    lib.ioctl_loop.restype = ctypes.c_longlong
    lib.ioctl_loop.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    buf = ctypes.create_string_buffer(32)

    def run(fd: int, cmd: int, calls: int) -> int:
        return int(lib.ioctl_loop(fd, cmd, calls, ctypes.addressof(buf)))

    return run


def ctypes_loop() -> Loop:
    libc = ctypes.CDLL(None, use_errno=True)
    ioctl, getppid = libc.ioctl, libc.getppid
    ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    address = ctypes.addressof(ctypes.create_string_buffer(32))

    def run(fd: int, cmd: int, calls: int) -> int:
        started = time.perf_counter_ns()
        if cmd < 0:
            for _ in range(calls):
                getppid()
        else:
            for _ in range(calls):
                ioctl(fd, cmd, address)
        return time.perf_counter_ns() - started

    return run


class Floor:
    """Empty programs on the tracer's two tracepoints."""

    def __init__(self) -> None:
        import bcc  # noqa: PLC0415

        self._bpf: Any = bcc.BPF(text=FLOOR_C.encode())

    def attach(self) -> None:
        self._bpf.attach_tracepoint(tp=TRACEPOINT_ENTER.encode(), fn_name=b"vcuda_ioctl_enter")
        self._bpf.attach_tracepoint(tp=TRACEPOINT_EXIT.encode(), fn_name=b"vcuda_ioctl_exit")

    def detach(self) -> None:
        self._bpf.detach_tracepoint(tp=TRACEPOINT_ENTER.encode())
        self._bpf.detach_tracepoint(tp=TRACEPOINT_EXIT.encode())

    def close(self) -> None:
        self._bpf.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200_000, help="syscalls per block")
    parser.add_argument("--no-cc", action="store_true", help="use the ctypes loop even if a compiler exists")
    args = parser.parse_args()

    support = probe_bpf()
    if not support.usable:
        print(f"cannot trace here: {support.reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vc-ioctl-bench-") as workdir:
        loop = None if args.no_cc else c_loop(Path(workdir))
        kind = "C loop" if loop is not None else "ctypes loop"
        loop = loop or ctypes_loop()
        fd = os.open("/dev/null", os.O_RDWR)
        tracer, floor = IoctlTracer(), Floor()
        tracer.start()
        tracer.detach()
        print(f"{args.rounds} rounds x {args.calls} calls per block on /dev/null ({kind}); ns per call")
        try:
            return measure(tracer, floor, loop, fd, (args.rounds, args.calls))
        finally:
            tracer.stop()
            floor.close()
            os.close(fd)


def measure(tracer: IoctlTracer, floor: Floor, loop: Loop, fd: int, size: tuple[int, int]) -> int:
    rounds, calls = size
    switch: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "off": (lambda: None, lambda: None),
        "tracer": (tracer.attach, tracer.detach),
        "floor": (floor.attach, floor.detach),
    }
    conditions = list(switch)
    for cmd in CMDS.values():  # warm-up
        loop(fd, cmd, calls // 10)
    results: dict[tuple[str, str], list[float]] = {(c, w): [] for c in conditions for w in CMDS}
    for i in range(rounds):
        for condition in conditions[i % 3 :] + conditions[: i % 3]:  # rotate the order per round
            attach, detach = switch[condition]
            attach()
            for what, cmd in CMDS.items():
                results[(condition, what)].append(loop(fd, cmd, calls) / calls)
            detach()
    print(f"{'':>8} {'off':>8} {'tracer':>8} {'floor':>8} {'Δ tracer':>9} {'Δ floor':>8} {'ours':>7}")
    deltas = {}
    for what in CMDS:
        off, ours, empty = (results[(c, what)] for c in ("off", "tracer", "floor"))
        d_tracer = statistics.median(t - o for t, o in zip(ours, off, strict=True))
        d_floor = statistics.median(f - o for f, o in zip(empty, off, strict=True))
        d_ours = statistics.median(t - f for t, f in zip(ours, empty, strict=True))
        deltas[what] = d_tracer
        print(
            f"{what:>8} {statistics.median(off):>8.1f} {statistics.median(ours):>8.1f} "
            f"{statistics.median(empty):>8.1f} {d_tracer:>+9.1f} {d_floor:>+8.1f} {d_ours:>+7.1f}"
        )
    print("Δ: median per-round difference to 'off'; ours: tracer minus floor (our programs' own work)")
    report_reads(tracer, loop, fd, rounds * calls)
    print(
        f"RESULT ioctl_overhead_ns={deltas['nv']:.1f} other_ioctl_overhead_ns={deltas['other']:.1f} "
        f"rounds={rounds}"
    )
    return 0


def report_reads(tracer: IoctlTracer, loop: Loop, fd: int, expected: int) -> None:
    """Map reading, the agent's cost every control period, with 100 more processes x 10 escapes."""
    tracer.attach()
    counted = sum(s.calls for s in tracer.snapshot().for_pid(os.getpid()))
    print(f"tracer counted {counted} NVIDIA ioctls from this process (expected {expected})")
    children = []
    for _ in range(100):
        pid = os.fork()
        if pid == 0:  # a short-lived process with 10 distinct escapes
            for escape in range(0x40, 0x4A):
                loop(fd, iowr(NV_IOCTL_MAGIC, escape, 32), 1)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    reads = []
    for _ in range(50):
        started = time.perf_counter()
        snapshot = tracer.snapshot()
        reads.append(time.perf_counter() - started)
    rows = sum(len(s.calls_by_escape) for s in snapshot.processes.values())
    median_ms = statistics.median(reads) * 1e3
    print(
        f"snapshot() of {len(snapshot.processes)} processes, {rows} (process, escape) rows: "
        f"{median_ms:.2f} ms"
    )
    started = time.perf_counter()
    removed = tracer.forget(*children)
    took_ms = (time.perf_counter() - started) * 1e3
    print(f"forget() of the 100 exited processes ({removed} entries): {took_ms:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
