"""Memory mode deny on this kernel: the BPF LSM probe, the real load attempt, and the fallback.

The development machine refuses BPF LSM programs, so here the probe must say why it is not
usable (or, if it claims it is, loading must fail with the clear error), the failed start
must leave nothing loaded, and the agent must fall back to killing with one warning. On a
kernel that runs BPF LSM the same test loads the program, checks its quota map and unloads it.
"""

from __future__ import annotations

import logging
import os

import pytest

from agent.control.memguard import open_deny_program
from agent.domain.memquota import MIB
from agent.platform.bpf.lsm import LsmSupport, MemoryDenyError, MemoryDenyProgram, probe_bpf_lsm


def bpf_objects() -> list[str]:
    """This process's BPF maps, programs and links (anon inodes named bpf-map, bpf-prog, bpf_link)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd of the listing itself, closed meanwhile
        if target.startswith("anon_inode:bpf"):
            found.append(target)
    return sorted(found)


def test_probe_and_load_on_this_kernel() -> None:
    support = probe_bpf_lsm()
    if not support.usable:
        assert support.reason, "an unusable probe must say why"
    before = bpf_objects()
    program = MemoryDenyProgram()
    try:
        program.start()
    except MemoryDenyError as err:
        # This machine: the kernel refuses BPF LSM programs. The message must say so plainly.
        assert "the kernel refused to load or attach the BPF LSM program" in str(err)
        assert not program.running
        assert bpf_objects() == before, "a refused start left BPF objects open"
        return
    try:  # a kernel that runs BPF LSM: the probe must have agreed, and the map must work
        assert support.usable, f"the program loaded although the probe said: {support.reason}"
        program.set_quota(424242, 1024 * MIB, 100 * MIB)
        assert program.quotas()[424242] == (1024 * MIB, 100 * MIB)
        program.remove_quota(424242)
        assert 424242 not in program.quotas()
    finally:
        program.stop()
    assert bpf_objects() == before, "stop() left BPF objects open"


def test_deny_falls_back_to_kill_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    support = probe_bpf_lsm()
    before = bpf_objects()
    with caplog.at_level(logging.WARNING, logger="agent.control.memguard"):
        program = open_deny_program(MemoryDenyProgram(), support)
        if program is not None:  # a kernel that runs BPF LSM
            program.stop()
            return
        # Even when the probe is fooled (as if securityfs said bpf), the load refusal falls back.
        forced = open_deny_program(MemoryDenyProgram(), LsmSupport(True, ""))
    assert forced is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert all("memory mode deny is unavailable" in w and "killed instead" in w for w in warnings)
    assert support.usable or support.reason in warnings[0]
    assert "refused" in warnings[1]
    assert bpf_objects() == before
