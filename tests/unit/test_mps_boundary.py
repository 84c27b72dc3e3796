"""MPS errors are translated at the platform boundary: a daemon whose directories cannot be
made or whose record cannot be written, a control command that is missing, not permitted,
hangs or fails, a daemon that cannot be signalled: each is a project error (PlatformError)
raised from the OS error, and the sharing layer holds such shares by the freezer instead of
letting an OSError escape."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from agent.control.mpsdaemons import DaemonPool
from agent.control.mpssharing import MpsSharing
from agent.domain.requests import ResolvedRequest
from agent.errors import MpsCommandError, MpsUnavailableError, PlatformError
from agent.platform import mpsv3
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.mpsdaemon import DaemonState, MpsDaemon
from agent.settings import SharingMode, SharingSettings

GPU = GpuInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", 81559, 0, "", 0)


def test_a_pipe_directory_that_cannot_be_made_is_a_project_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "mps"
    root.write_text("a file where the MPS root should be")
    daemon = MpsDaemon(0, GPU.uuid, [sys.executable, "-c", "pass"], root)
    with pytest.raises(MpsUnavailableError, match="cannot prepare its directories") as caught:
        daemon.ensure(0.0)
    assert isinstance(caught.value, PlatformError) and isinstance(caught.value.__cause__, OSError)
    assert daemon.state is DaemonState.STOPPED and "cannot prepare" in daemon.status().error
    # Allocate and the supervision tick hear it as a project error: the freezer holds the share.
    sharing = MpsSharing(
        SharingSettings(mode=SharingMode.MPS, mps_root=root, advisory_limits=True, idle_stop_s=0.0),
        gpus=[GPU],
        command=[sys.executable, "-c", "pass"],
        mode=lambda: SharingMode.MPS,
        shares_on=lambda _gpu: 1,
    )
    with caplog.at_level(logging.ERROR):
        assert sharing.grant_for(ResolvedRequest(30, (GPU,)), None) is None
        sharing.resume()
        sharing.tick()
    assert "cannot prepare its directories" in caplog.text and "held by the freezer" in caplog.text
    assert not sharing.concurrent(0)


def test_a_daemon_whose_record_cannot_be_written_is_not_left_running(tmp_path: Path) -> None:
    marker = f"vcuda-test-{uuid.uuid4()}"
    command = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    daemon = MpsDaemon(0, GPU.uuid, command, tmp_path)
    (tmp_path / GPU.uuid / "daemon.json").mkdir(parents=True)  # no file can replace a directory
    with pytest.raises(MpsUnavailableError, match="cannot record it") as caught:
        daemon.ensure(0.0)
    assert isinstance(caught.value.__cause__, PlatformError)
    assert daemon.status().pid is None and daemon.state is not DaemonState.RUNNING
    assert not [p for p in Path("/proc").glob("[0-9]*") if marker.encode() in _cmdline(p)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def raising(err: BaseException) -> mpsv3.Runner:
    def run(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        raise err

    return run


@pytest.mark.parametrize(
    ("err", "said"),
    [
        (FileNotFoundError(2, "No such file or directory"), "No such file"),
        (PermissionError(13, "Permission denied"), "Permission denied"),
        (subprocess.TimeoutExpired(["c"], 5), "no answer within 5 s"),
        (subprocess.CalledProcessError(1, ["c"]), "exited 1"),
    ],
    ids=["missing", "not-permitted", "hangs", "failed"],
)
def test_control_command_errors_become_mps_command_errors(tmp_path: Path, err: Exception, said: str) -> None:
    with pytest.raises(MpsCommandError, match=said) as caught:
        mpsv3.run_control(["c", "-p", "3", "namespace", "list"], timeout_s=5, run=raising(err))
    assert caught.value.__cause__ is err
    why = mpsv3.send(["c", "-f"], tmp_path, ["namespace", "list"], environ={}, run=raising(err))
    assert why is not None and why.startswith("namespace list: ")
    assert not mpsv3.probe_v3(["c", "-f"], raising(err))[0]


def test_a_missing_control_program_is_an_mps_command_error(tmp_path: Path) -> None:
    with pytest.raises(MpsCommandError) as caught:
        mpsv3.run_control([str(tmp_path / "nvidia-cuda-mps-control"), "-h"], timeout_s=5)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


class Unkillable(MpsDaemon):
    def __init__(self, root: Path) -> None:
        super().__init__(GPU.index, GPU.uuid, ["held"], root)
        self.state = DaemonState.RUNNING

    def stop(self) -> None:
        raise MpsCommandError("cannot signal the MPS control daemon pid 4242: Operation not permitted")


def test_a_daemon_that_cannot_be_stopped_is_reported_not_raised(tmp_path: Path) -> None:
    told: list[str] = []
    pool = DaemonPool(
        [GPU], ["held"], tmp_path, idle_stop_s=0.0, shares_on=lambda _gpu: 0, report=told.append
    )
    pool.daemons[GPU.index] = Unkillable(tmp_path)
    pool.tick(0.0)
    assert told == [
        "GPU 0: the MPS control daemon was not stopped "
        "(cannot signal the MPS control daemon pid 4242: Operation not permitted)"
    ]
