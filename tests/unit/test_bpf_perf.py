"""Perf event attributes for attaching BPF programs, and the loader's wire format (no kernel needed).

The kprobe path cannot run on the development kernel (no kprobes), so its attribute building
is checked here field by field against what libbpf's perf_event_open_probe builds.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path

import pytest

from agent.platform.bpf import perf
from agent.platform.bpf.loader import recv_message, send_message


def test_attr_layout_is_perf_attr_size_ver5() -> None:
    assert ctypes.sizeof(perf.PerfEventAttr) == perf.PERF_ATTR_SIZE_VER5 == 112
    assert perf.PerfEventAttr.config1.offset == 56 and perf.PerfEventAttr.wakeup_events.offset == 48


def test_tracepoint_attr_matches_bcc() -> None:
    attr = perf.tracepoint_attr(731)
    assert (attr.type, attr.size, attr.config) == (perf.PERF_TYPE_TRACEPOINT, 112, 731)
    assert (attr.sample_period, attr.wakeup_events, attr.flags, attr.config1) == (1, 1, 0, 0)


def fake_pmu(tmp_path: Path, pmu_type: str = "8\n", retprobe: str = "config:0\n") -> Path:
    pmu = tmp_path / "kprobe"
    (pmu / "format").mkdir(parents=True)
    (pmu / "type").write_text(pmu_type)
    (pmu / "format" / "retprobe").write_text(retprobe)
    return pmu


@pytest.mark.parametrize(("retprobe", "config"), [(False, 0), (True, 1 << 3)])
def test_kprobe_attr_names_the_function_and_sets_the_return_bit(
    tmp_path: Path, retprobe: bool, config: int
) -> None:
    pmu_type, bit = perf.kprobe_pmu(fake_pmu(tmp_path, retprobe="config:3\n"))
    assert (pmu_type, bit) == (8, 3)
    name = ctypes.create_string_buffer(b"nvidia_unlocked_ioctl")
    attr = perf.kprobe_attr(pmu_type, bit, name, retprobe=retprobe)
    assert (attr.type, attr.size, attr.config, attr.config2) == (8, 112, config, 0)
    assert ctypes.string_at(attr.config1) == b"nvidia_unlocked_ioctl"
    assert (attr.sample_period, attr.wakeup_events) == (1, 1)


def test_no_kprobe_pmu_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(perf.PerfAttachError, match="no kprobe PMU"):
        perf.kprobe_pmu(tmp_path / "missing")
    with pytest.raises(perf.PerfAttachError, match="cannot read the kprobe PMU"):
        perf.kprobe_pmu(fake_pmu(tmp_path, retprobe="garbage"))


def test_tracepoint_id_from_the_first_tracefs_that_has_it(tmp_path: Path) -> None:
    first, second = tmp_path / "tracing", tmp_path / "debug" / "tracing"
    event = second / "events" / "syscalls" / "sys_enter_ioctl"
    event.mkdir(parents=True)
    (event / "id").write_text("1234\n")
    assert perf.tracepoint_id("syscalls", "sys_enter_ioctl", (first, second)) == 1234
    with pytest.raises(perf.PerfAttachError, match="no tracepoint syscalls:sys_exit_ioctl"):
        perf.tracepoint_id("syscalls", "sys_exit_ioctl", (first, second))


def test_wire_format_carries_json_and_fds() -> None:
    ours, theirs = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        big = {"text": "x" * 100_000, "n": [1, 2]}  # longer than one recv
        send_message(theirs, big, [read_end])
        message, fds = recv_message(ours, 4)
        assert message == big and len(fds) == 1
        os.write(write_end, b"through the passed fd")
        assert os.read(fds[0], 64) == b"through the passed fd"
        assert os.get_inheritable(fds[0]) is False
        os.close(fds[0])
        theirs.close()
        with pytest.raises(EOFError):
            recv_message(ours, 4)
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        ours.close()
