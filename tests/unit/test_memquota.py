"""GPU memory quota decisions: usage, verdicts, culprits, and the deny program's mirror."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.domain.memquota import (
    MIB,
    VIDEO_MEMORY_CLASS,
    AllocationTimes,
    ProcessUse,
    format_mib,
    judge,
    lsm_allows,
)
from agent.platform.procfs import ProcessIdentity

LSM_SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "memquota_lsm.c"


def use(
    pid: int, nvml_mib: float, traced_mib: float | None = None, last_alloc_ns: int | None = None
) -> ProcessUse:
    traced = None if traced_mib is None else int(traced_mib * MIB)
    return ProcessUse(ProcessIdentity(pid, 1000 + pid), int(nvml_mib * MIB), traced, last_alloc_ns)


def test_used_bytes_is_the_larger_of_nvml_and_the_tracer() -> None:
    assert use(10, 300, 500).used_bytes == 500 * MIB  # NVML lags an allocation the tracer saw
    assert use(10, 700, 500).used_bytes == 700 * MIB  # allocated before the tracer started
    assert use(10, 300).used_bytes == 300 * MIB  # no tracer


def test_under_and_exactly_at_quota_are_not_over() -> None:
    under = judge(1024, [use(10, 300), use(11, 500)])
    assert not under.over and under.culprit is None
    assert under.used_bytes == 800 * MIB and under.quota_bytes == 1024 * MIB
    assert not judge(1024, [use(10, 1024)]).over  # using exactly the quota is allowed
    assert judge(1024, [use(10, 1024), use(11, 1 / MIB)]).over  # one byte more is not
    assert not judge(1024, []).over


def test_over_without_tracer_data_blames_the_largest_user() -> None:
    verdict = judge(1024, [use(10, 300), use(11, 900), use(12, 100)])
    assert verdict.over
    assert verdict.culprit is not None and verdict.culprit.pid == 11
    assert verdict.used_bytes == 1300 * MIB
    assert "holds the most" in verdict.reason


def test_over_with_tracer_data_blames_the_latest_allocation() -> None:
    # pid 11 holds the most but pid 10 allocated last: its allocation crossed the line.
    processes = [use(10, 100, 300, last_alloc_ns=5_000), use(11, 900, 900, last_alloc_ns=2_000)]
    verdict = judge(1024, processes)
    assert verdict.over
    assert verdict.culprit is not None and verdict.culprit.pid == 10
    assert "most recent" in verdict.reason


def test_a_process_that_freed_everything_is_not_blamed() -> None:
    processes = [use(10, 0, 0, last_alloc_ns=9_000), use(11, 1100, 1100, last_alloc_ns=2_000)]
    verdict = judge(1024, processes)
    assert verdict.culprit is not None and verdict.culprit.pid == 11


def test_reason_names_the_figures_and_the_pid() -> None:
    verdict = judge(1024, [use(4242, 1500), use(17, 12.5)])
    assert "1512.5 MiB" in verdict.reason
    assert "1024 MiB" in verdict.reason
    assert "pid 4242 (1500 MiB)" in verdict.reason
    assert "pid 17" not in verdict.reason


def test_format_mib() -> None:
    assert format_mib(1024 * MIB) == "1024 MiB"
    assert format_mib(3 * MIB // 2) == "1.5 MiB"


@pytest.mark.parametrize("hclass", [0x3E, 0x70, 0x50A0, 0xC86F, 0x41])
def test_lsm_never_refuses_other_classes(hclass: int) -> None:
    assert lsm_allows(quota_bytes=0, used_bytes=10 * MIB, request_bytes=1 << 40, hclass=hclass)


def test_lsm_boundary_for_video_memory() -> None:
    quota = 1024 * MIB
    assert lsm_allows(quota, 1000 * MIB, 24 * MIB, VIDEO_MEMORY_CLASS)  # == quota is allowed
    assert not lsm_allows(quota, 1000 * MIB, 24 * MIB + 1, VIDEO_MEMORY_CLASS)
    assert lsm_allows(quota, 0, 0, VIDEO_MEMORY_CLASS)
    assert not lsm_allows(quota, quota + 1, 0, VIDEO_MEMORY_CLASS)  # already over: nothing more


def test_the_c_program_takes_the_same_decision() -> None:
    """The mirror is only worth its tests while the C program says the same thing."""
    text = LSM_SOURCE.read_text()
    allows = re.search(r"static __always_inline int allows\((.*?)\n}", text, re.S)
    assert allows is not None, "allows() is missing from bpf/memquota_lsm.c"
    body = allows.group(1)
    assert "h_class != NV01_MEMORY_LOCAL_USER" in body and "return 1;" in body
    assert "return used_bytes + request_bytes <= quota_bytes;" in body
    assert "#define NV01_MEMORY_LOCAL_USER 0x40" in text and VIDEO_MEMORY_CLASS == 0x40
    assert "return -ENOMEM;" in text
    assert "lsm_allows" in text  # the comment tying them together


def test_allocation_times_stamp_growth_only() -> None:
    times = AllocationTimes()
    assert times.observe({10: 100, 11: 0}, now_ns=1_000) == {10: 1_000}
    assert times.observe({10: 100, 11: 50}, now_ns=2_000) == {10: 1_000, 11: 2_000}
    assert times.observe({10: 300, 11: 50}, now_ns=3_000) == {10: 3_000, 11: 2_000}
    assert times.observe({10: 300}, now_ns=4_000) == {10: 3_000}  # 11 left the tracer: forgotten
