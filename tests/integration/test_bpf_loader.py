"""The BPF loader child on this kernel: programs compiled and loaded by ``python -m
agent.platform.bpf.loader``, attached and read from the test process with raw syscalls, the
failures reported with bcc's own words, and bcc (libbcc, LLVM) kept out of the agent process.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.errors import VcudaError
from agent.platform.bpf import ioctl_tracer, perf, syscall
from agent.platform.bpf.ioctl_tracer import IoctlTracer, IoctlTracerError
from agent.platform.bpf.loaded import LoadError, load

pytestmark = pytest.mark.privileged

COUNTER = r"""
BPF_ARRAY(hits, u64, 1);
int count_getppid(void *ctx) {
    if ((u32)bpf_get_current_pid_tgid() != THREAD)  // this thread only: pytest's others stay out
        return 0;
    int zero = 0;
    u64 *v = hits.lookup(&zero);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
"""


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")


def bpf_fds(pid: int | str = "self") -> list[str]:
    """The open BPF maps, programs and links of a process."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing (or the listing's own fd)
        if target.startswith("anon_inode:bpf"):
            found.append(target)
    return sorted(found)


def bcc_mapped(pid: int | str = "self") -> list[str]:
    """Lines of /proc/<pid>/maps that come from bcc or LLVM."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in lines if re.search(r"libbcc|libLLVM|libclang", line)]


def test_round_trip_counts_exactly_and_detaches() -> None:
    text = COUNTER.replace("THREAD", str(threading.get_native_id()))
    loaded = load(text, [("count_getppid", "tracepoint")], ["hits"])
    try:
        program, hits = loaded.program("count_getppid"), loaded["hits"]
        assert program.id == syscall.prog_info(program.fd).id > 0
        assert (hits.key_size, hits.value_size, hits.max_entries) == (4, 8, 1)
        zero = struct.pack("=I", 0)
        assert hits.lookup(zero) == struct.pack("=Q", 0)

        event = perf.attach_tracepoint(program.fd, "syscalls", "sys_enter_getppid")
        for _ in range(1234):
            os.getppid()
        os.close(event)  # detached: the calls below are not seen
        for _ in range(10):
            os.getppid()
        assert struct.unpack("=Q", hits.lookup(zero) or b"") == (1234,)

        hits.update(zero, struct.pack("=Q", 7))
        assert hits.lookup(zero) == struct.pack("=Q", 7)
        assert list(hits.keys()) == [zero]
    finally:
        loaded.close()
    assert bcc_mapped() == [], "bcc was mapped into the test process"


def test_hash_map_operations_through_raw_syscalls() -> None:
    loaded = load("BPF_HASH(h, u32, struct { u64 a; u64 b; }, 8);", [], ["h"])
    try:
        table = loaded["h"]
        key = struct.Struct("=I")
        assert (table.key_size, table.value_size, len(table)) == (4, 16, 8)
        assert table.lookup(key.pack(1)) is None and list(table.keys()) == []
        for i in range(1, 6):
            table.update(key.pack(i), struct.pack("=QQ", i, i * i))
        assert sorted(key.unpack(k)[0] for k in table) == [1, 2, 3, 4, 5]
        assert table.delete(key.pack(3)) and not table.delete(key.pack(3))
        assert dict(table.items()) == {key.pack(i): struct.pack("=QQ", i, i * i) for i in (1, 2, 4, 5)}
        with pytest.raises(ValueError, match="key of 8 bytes"):
            table.lookup(struct.pack("=Q", 1))
        for i in range(10, 14):  # 8 entries: full
            table.update(key.pack(i), bytes(16))
        with pytest.raises(syscall.BpfSyscallError, match="errno 7"):  # E2BIG: the map is full
            table.update(key.pack(99), bytes(16))
    finally:
        loaded.close()


def test_a_program_that_does_not_compile_reports_clangs_error(tmp_path: Path) -> None:
    before = bpf_fds()
    with pytest.raises(LoadError) as caught:
        load("int f(void *ctx) { return undefined_symbol; }", [("f", "tracepoint")], [])
    err = caught.value
    assert err.stage == "compile"
    assert "Failed to compile BPF module" in err.error
    assert "use of undeclared identifier 'undefined_symbol'" in err.detail
    assert "use of undeclared identifier 'undefined_symbol'" in str(err)

    broken = tmp_path / "broken.c"
    broken.write_text("int vcuda_ioctl_enter(void *ctx) { return undefined_symbol; }\n")
    with pytest.raises(IoctlTracerError) as tracer_error:
        IoctlTracer(source_path=broken, task_storage=True).start()
    message = str(tracer_error.value)
    assert message.startswith("compiling the ioctl tracer failed (Exception: Failed to compile BPF module")
    assert "undeclared identifier 'undefined_symbol'" in message and "bcc needs kernel headers" in message
    assert bpf_fds() == before


def test_the_verifier_refusal_names_the_program_and_keeps_the_log() -> None:
    text = """
    BPF_HASH(m, u32, u64, 4);
    int unchecked(void *ctx) {
        u32 key = 0;
        u64 *v = m.lookup(&key);
        return *v;  // no NULL check: the verifier refuses
    }
    """
    before = bpf_fds()
    with pytest.raises(LoadError) as caught:
        load(text, [("unchecked", "tracepoint")], ["m"])
    assert caught.value.stage == "load" and caught.value.name == "unchecked"
    assert "Failed to load BPF program b'unchecked'" in caught.value.error
    assert "invalid mem access" in caught.value.diagnostics
    assert bpf_fds() == before


def test_a_missing_map_is_an_error_and_leaks_nothing() -> None:
    before = bpf_fds()
    with pytest.raises(LoadError) as caught:
        load("BPF_ARRAY(present, u64, 1);", [], ["present", "absent"])
    assert caught.value.stage == "map" and caught.value.name == "absent"
    assert bpf_fds() == before


def test_a_loader_that_dies_is_reported(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'the loader broke' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(LoadError) as caught:
        load("BPF_ARRAY(a, u64, 1);", [], ["a"], python=str(fake))
    assert caught.value.stage == "child"
    assert "exit status 3" in str(caught.value) and "the loader broke" in str(caught.value)


def test_a_hung_loader_is_killed_at_the_timeout(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(LoadError, match="the BPF loader process timed out") as caught:
        load("BPF_ARRAY(a, u64, 1);", [], ["a"], python=str(fake), timeout_s=1.0)
    assert caught.value.stage == "child"
    assert time.monotonic() - started < 10


def test_the_tracer_reports_a_failed_loader_and_stays_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the agent turns into BPF status load-failed (and keeps serving on NVML alone)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Segmentation fault' >&2\nkill -SEGV $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(ioctl_tracer, "load", functools.partial(load, python=str(fake)))
    tracer = IoctlTracer()
    with pytest.raises(IoctlTracerError) as caught:
        tracer.start()
    message = str(caught.value)
    assert message.startswith("loading the ioctl tracer failed: the BPF loader process failed")
    assert "exit status -11" in message and "Segmentation fault" in message
    assert not tracer.running and not tracer.attached
    assert isinstance(caught.value, VcudaError)


# -- the real agent --------------------------------------------------------------------------------


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vc-e2-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_agent_process_never_maps_bcc(workdir: Path) -> None:
    """The real agent (Kubernetes mode, tracer on, device guard on) with one guarded pod."""
    from agent.emulators.enforcednode import enforced_node  # noqa: PLC0415  (heavy: this test only)

    with enforced_node(workdir, "1xH100-80GB") as node:
        node.run_pod("guarded", 50, memory_mib=1024, busy=0.05)
        pid = node.agent.pid
        wait_until(
            lambda: re.search(r'vcuda_bpf_status\{[^}]*status="ok"\} 1\.0', node.metrics()), 60, "the tracer"
        )
        wait_until(
            lambda: re.search(r"vcuda_device_guard_containers\{[^}]*\} 1\.0", node.metrics()), 60, "the guard"
        )
        assert bcc_mapped(pid) == [], "libbcc/LLVM mapped into the agent"
        assert bpf_fds(pid).count("anon_inode:bpf-prog") >= 3  # tracer enter/exit, device guard
        assert node.agent.poll() is None


def test_the_platform_layer_never_imports_bcc() -> None:
    """Every BPF user of the platform layer, started in a fresh interpreter."""
    code = """
import os, re, sys, tempfile
from pathlib import Path
from agent.platform.bpf.probe import probe_bpf
from agent.platform.bpf.lsm import MemoryDenyProgram, MemoryDenyError, probe_bpf_lsm
from agent.platform.bpf.ioctl_tracer import IoctlTracer
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
assert probe_bpf().usable
probe_bpf_lsm()
tracer = IoctlTracer()
tracer.start()
rules = BpfDeviceRules()
rules.load()
try:
    MemoryDenyProgram().start()
except MemoryDenyError:
    pass
tracer.snapshot()
mapped = [l for l in Path("/proc/self/maps").read_text().splitlines() if re.search("libbcc|libLLVM", l)]
print("bcc" in sys.modules, len(mapped))
tracer.stop()
rules.close()
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0"]
