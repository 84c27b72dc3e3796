"""BPF feature probes over fake /proc, /sys and /lib/modules trees."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.platform.bpf.ioctl_tracer import AttachMode
from agent.platform.bpf.probe import BpfStatus, ProbeRoots, probe_bpf

RELEASE = "6.1.0-test-amd64"
ALL_CAPS = (1 << 41) - 1
CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF, CAP_NET_ADMIN = 21, 38, 39, 12


def bcc_ok() -> None:
    return None


def bcc_missing() -> None:
    raise ImportError("No module named 'bcc'")


def make_tree(
    root: Path,
    *,
    caps: int = ALL_CAPS,
    headers: bool = True,
    tracefs: str | None = "kernel/tracing",
    ioctl_events: bool = True,
    kprobes: bool = False,
    nvidia: bool = False,
    kallsyms: str = "",
) -> ProbeRoots:
    roots = ProbeRoots(proc=root / "proc", sys=root / "sys", modules=root / "modules")
    (roots.proc / "self").mkdir(parents=True)
    (roots.proc / "self" / "status").write_text(f"Name:\tagent\nCapInh:\t0\nCapEff:\t{caps:016x}\n")
    (roots.proc / "modules").write_text("nvidia 1234 0 - Live 0x0\n" if nvidia else "ext4 1 0 - Live 0x0\n")
    (roots.proc / "kallsyms").write_text(kallsyms)
    roots.sys.mkdir()
    if headers:
        (roots.modules / RELEASE / "build" / "include").mkdir(parents=True)
    if tracefs:
        events = roots.sys / tracefs / "events"
        events.mkdir(parents=True)
        if ioctl_events:
            (events / "syscalls" / "sys_enter_ioctl").mkdir(parents=True)
            (events / "syscalls" / "sys_exit_ioctl").mkdir(parents=True)
        if kprobes:
            (roots.sys / tracefs / "kprobe_events").write_text("")
    return roots


def test_everything_present(tmp_path: Path) -> None:
    roots = make_tree(tmp_path)
    found = probe_bpf(roots, release=RELEASE, import_bcc=bcc_ok)
    assert found.status is BpfStatus.OK and found.usable and found.reason == ""
    assert found.headers == roots.modules / RELEASE / "build"
    assert found.tracefs == roots.sys / "kernel/tracing"
    assert (found.kprobes, found.nvidia_module, found.kprobe_function) == (False, False, None)
    assert found.attach_mode is AttachMode.TRACEPOINT


def test_debugfs_tracing_is_accepted(tmp_path: Path) -> None:
    found = probe_bpf(make_tree(tmp_path, tracefs="kernel/debug/tracing"), release=RELEASE, import_bcc=bcc_ok)
    assert found.status is BpfStatus.OK
    assert found.tracefs == tmp_path / "sys/kernel/debug/tracing"


def test_in_kernel_headers_are_accepted(tmp_path: Path) -> None:
    roots = make_tree(tmp_path, headers=False)
    (roots.sys / "kernel" / "kheaders.tar.xz").write_bytes(b"xz")
    found = probe_bpf(roots, release=RELEASE, import_bcc=bcc_ok)
    assert found.status is BpfStatus.OK and found.headers == roots.sys / "kernel/kheaders.tar.xz"


@pytest.mark.parametrize(
    ("tree", "import_bcc", "status", "reason"),
    [
        pytest.param({}, bcc_missing, BpfStatus.NO_BCC, "python3-bpfcc", id="no-bcc"),
        pytest.param({"caps": 1 << CAP_NET_ADMIN}, bcc_ok, BpfStatus.NOT_PERMITTED, "CAP_BPF", id="no-caps"),
        pytest.param(
            {"caps": 1 << CAP_BPF}, bcc_ok, BpfStatus.NOT_PERMITTED, "privileged", id="bpf-without-perfmon"
        ),
        pytest.param(
            {"headers": False},
            bcc_ok,
            BpfStatus.NO_HEADERS,
            f"{RELEASE}/build.*/lib/modules and /usr/src read-only",
            id="no-headers",
        ),
        pytest.param(
            {"tracefs": None}, bcc_ok, BpfStatus.NO_TRACEFS, "mount -t tracefs", id="tracefs-unmounted"
        ),
        pytest.param(
            {"ioctl_events": False},
            bcc_ok,
            BpfStatus.NO_TRACEFS,
            "CONFIG_FTRACE_SYSCALLS",
            id="no-syscall-tracepoints",
        ),
        # Checked in order: the first missing facility is the one reported.
        pytest.param(
            {"caps": 0, "headers": False, "tracefs": None},
            bcc_ok,
            BpfStatus.NOT_PERMITTED,
            "CapEff 0x0",
            id="first-failure-wins",
        ),
    ],
)
def test_each_missing_facility_has_its_status_and_reason(
    tmp_path: Path,
    tree: dict[str, Any],
    import_bcc: Callable[[], None],
    status: BpfStatus,
    reason: str,
) -> None:
    found = probe_bpf(make_tree(tmp_path, **tree), release=RELEASE, import_bcc=import_bcc)
    assert found.status is status and not found.usable
    assert re.search(reason, found.reason), found.reason


@pytest.mark.parametrize("caps", [1 << CAP_SYS_ADMIN, (1 << CAP_BPF) | (1 << CAP_PERFMON)])
def test_sys_admin_or_bpf_plus_perfmon_is_enough(tmp_path: Path, caps: int) -> None:
    assert probe_bpf(make_tree(tmp_path, caps=caps), release=RELEASE, import_bcc=bcc_ok).usable


@pytest.mark.parametrize("symbol", ["nvidia_unlocked_ioctl", "nvidia_frontend_unlocked_ioctl"])
def test_kprobe_on_the_driver_when_kprobes_and_module_exist(tmp_path: Path, symbol: str) -> None:
    kallsyms = f"ffffffff81000000 T do_vfs_ioctl\nffffffffc0a00000 t {symbol}\t[nvidia]\n"
    found = probe_bpf(
        make_tree(tmp_path, kprobes=True, nvidia=True, kallsyms=kallsyms), release=RELEASE, import_bcc=bcc_ok
    )
    assert found.kprobes and found.nvidia_module
    assert found.kprobe_function == symbol  # both driver generations are recognised
    assert found.attach_mode is AttachMode.KPROBE


def test_no_kprobe_without_the_module(tmp_path: Path) -> None:
    kallsyms = "ffffffffc0a00000 t nvidia_unlocked_ioctl\t[nvidia]\n"
    found = probe_bpf(
        make_tree(tmp_path, kprobes=True, kallsyms=kallsyms), release=RELEASE, import_bcc=bcc_ok
    )
    assert (found.kprobes, found.nvidia_module, found.kprobe_function) == (True, False, None)
    assert found.attach_mode is AttachMode.TRACEPOINT


def test_module_seen_in_sys_module(tmp_path: Path) -> None:
    roots = make_tree(tmp_path)
    (roots.sys / "module" / "nvidia").mkdir(parents=True)
    assert probe_bpf(roots, release=RELEASE, import_bcc=bcc_ok).nvidia_module


def test_load_failure_keeps_the_findings(tmp_path: Path) -> None:
    found = probe_bpf(make_tree(tmp_path), release=RELEASE, import_bcc=bcc_ok)
    failed = found.load_failed(RuntimeError("attaching the ioctl tracer failed: EPERM"))
    assert failed.status is BpfStatus.LOAD_FAILED and "EPERM" in failed.reason
    assert failed.tracefs == found.tracefs and not failed.usable


def test_status_values_are_stable() -> None:
    assert [s.value for s in BpfStatus] == [
        "ok",
        "no-bcc",
        "not-permitted",
        "no-headers",
        "no-tracefs",
        "load-failed",
    ]
