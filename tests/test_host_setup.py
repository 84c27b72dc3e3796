"""What `make` set up on the host: Debian's bcc in the venv, kernel headers, a working BPF toolchain."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import pytest

pytestmark = pytest.mark.privileged

SYS_GETPPID = {"x86_64": 110, "aarch64": 173}.get(platform.machine())


def test_bcc_is_debians_package() -> None:
    bcc = pytest.importorskip("bcc", reason="Debian's python3-bpfcc is not linked into the venv")
    assert os.path.realpath(bcc.__file__).startswith("/usr/lib/python3/dist-packages/bcc/")


def test_kernel_headers_are_linked() -> None:
    build = Path("/lib/modules") / os.uname().release / "build"
    assert (build / "include").is_dir(), f"{build} has no headers: run deploy/host/setup.sh"


def test_tracepoint_counts_a_known_workload_exactly() -> None:
    """Compile and attach a real tracepoint program; it must see exactly our 137 getppid calls."""
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    if SYS_GETPPID is None:
        pytest.skip(f"no getppid syscall number for {platform.machine()}")
    bcc = pytest.importorskip("bcc")
    program = bcc.BPF(
        text=b"""
        BPF_ARRAY(calls, u64, 1);
        TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
            if ((bpf_get_current_pid_tgid() >> 32) != TARGET_TGID) return 0;
            int zero = 0;
            u64 *n = calls.lookup(&zero);
            if (n) __sync_fetch_and_add(n, 1);
            return 0;
        }
        """,
        cflags=[f"-DTARGET_TGID={os.getpid()}"],
    )
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for _ in range(137):
            libc.syscall(SYS_GETPPID)
        assert program[b"calls"][ctypes.c_int(0)].value == 137
    finally:
        program.cleanup()
