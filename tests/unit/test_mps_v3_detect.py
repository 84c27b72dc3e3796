"""Detecting MPS v3 and the dmem controller (agent.platform.mpsv3): the documented checks,
``<control> -p 3 -h`` listing the server and namespace modules and
``/sys/fs/cgroup/dmem.capacity`` listing ``nvidia/<pci>/vidmem`` per GPU, with what answers
injected; anything else (an older driver's refusal, a missing file, odd lines) is "no"."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from agent.platform import mpsv3

V3_HELP = "Usage: nvidia-cuda-mps-control -p 3 <module> <verb>\nModules:\n  server ...\n  namespace ...\n"


def runner(rc: int, out: str = "", err: str = "", raises: Exception | None = None) -> Any:
    calls: list[list[str]] = []

    def run(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(argv, rc, out, err)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_a_control_that_lists_server_and_namespace_under_protocol_3_has_v3() -> None:
    run = runner(0, V3_HELP)
    ok, detail = mpsv3.probe_v3(["nvidia-cuda-mps-control", "-f"], run)
    assert ok and "server and namespace" in detail
    assert run.calls == [["nvidia-cuda-mps-control", "-p", "3", "-h"]]  # -f is the daemon's, not the probe's


def test_an_older_control_or_one_that_cannot_run_has_no_v3() -> None:
    refused = runner(1, "", "nvidia-cuda-mps-control: invalid option -- 'p'")
    assert mpsv3.probe_v3(["nvidia-cuda-mps-control", "-f"], refused) == (
        False,
        "-p 3 -h exited 1 without the server and namespace modules",
    )
    legacy_help = runner(0, "get_server_list start_server set_default_active_thread_percentage")
    assert not mpsv3.probe_v3(["c", "-f"], legacy_help)[0]  # a help text without the modules
    missing = runner(0, raises=FileNotFoundError(2, "No such file or directory"))
    ok, detail = mpsv3.probe_v3(["nvidia-cuda-mps-control", "-f"], missing)
    assert not ok and "No such file" in detail
    hangs = runner(0, raises=subprocess.TimeoutExpired(["c"], 5))
    assert not mpsv3.probe_v3(["c"], hangs)[0]
    assert not mpsv3.probe_v3([], runner(0, V3_HELP))[0]


def test_dmem_regions_are_matched_to_gpus_by_pci_address(tmp_path: Path) -> None:
    capacity = tmp_path / "dmem.capacity"
    capacity.write_text(
        "drm/0000:03:00.0/vram0 8589934592\n"
        "nvidia/0000:3b:00.0/vidmem 85899345920\n"
        "nvidia/garbage/vidmem 1\n"
        "\n"
        "nvidia/0000:5e:00.0/sysmem 1\n"
    )
    found = mpsv3.probe_dmem({0: "00000000:3B:00.0", 1: "00000000:5E:00.0", 2: "not a bus id"}, capacity)
    assert found == {0: True, 1: False, 2: False}
    assert mpsv3.probe_dmem({0: "00000000:3B:00.0"}, tmp_path / "absent") == {0: False}  # kernel < 6.14


def test_the_capability_says_unverified_on_hardware(tmp_path: Path) -> None:
    (tmp_path / "dmem.capacity").write_text("nvidia/0000:18:00.0/vidmem 1\n")
    cap = mpsv3.detect(
        ["c", "-f"], {0: "00000000:18:00.0"}, run=runner(0, V3_HELP), capacity=tmp_path / "dmem.capacity"
    )
    assert cap.v3 and cap.dmem == {0: True} and not cap.verified
    assert cap.describe() == f"MPS v3 namespaces: yes; dmem: GPU 0 yes [{mpsv3.UNVERIFIED}]"
    assert cap.describe_gpu(0) == f"MPS v3 namespaces: yes; dmem: yes, {mpsv3.UNVERIFIED}"
    assert cap.describe_gpu(1).startswith("MPS v3 namespaces: yes; dmem: no")
    old = mpsv3.detect(["c"], {0: "00000000:18:00.0"}, run=runner(1), capacity=tmp_path / "none")
    assert old.describe().startswith("MPS v3 namespaces: no (-p 3 -h exited 1")


def test_a_shares_namespace_commands_carry_its_limits_and_cgroup() -> None:
    name = mpsv3.namespace_name("pod-uid", "main")
    assert name == mpsv3.namespace_name("pod-uid", "main") != mpsv3.namespace_name("pod-uid", "side")
    assert name.startswith("vcuda-") and name.replace("-", "").isalnum()
    cgroup = Path("/sys/fs/cgroup/kubepods.slice/pod/ctr")
    assert mpsv3.namespace_commands(name, 8, 2048, cgroup) == [
        ["namespace", "create", f"--name={name}"],
        ["namespace", "set", f"--name={name}", "--active-thread-percentage=8"],
        ["namespace", "set", f"--name={name}", "--pinned-memory-limit=2048M"],
        ["namespace", "bind", f"--name={name}", f"--cgroup={cgroup}"],
    ]
    assert len(mpsv3.namespace_commands(name, 8, None, None)) == 2  # no memory limit, cgroup not known yet


def test_a_command_the_daemon_refuses_is_reported(tmp_path: Path) -> None:
    ok = runner(0, "")
    assert mpsv3.send(["c", "-f"], tmp_path, ["namespace", "list"], environ={}, run=ok) is None
    assert ok.calls == [["c", "-p", "3", "namespace", "list"]]
    refused = runner(0, "Error: permission denied")
    why = mpsv3.send(["c"], tmp_path, ["namespace", "set"], environ={}, run=refused)
    assert why is not None and "permission denied" in why
    failed = runner(2, "", "cannot connect")
    why = mpsv3.send(["c"], tmp_path, ["namespace", "list"], environ={}, run=failed)
    assert why is not None and "exited 2" in why and "cannot connect" in why
