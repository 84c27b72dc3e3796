"""The real-runtime tier: a private containerd per runtime and cgroup mode (never the
system's). Skips, with the reason, where the binaries or root are missing; on CI
(``VCUDA_REQUIRE_PRIVILEGED=1``) such a skip fails the run like every privileged test's."""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.platform.cgroups.devicepolicy import NvidiaMajors
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from tests.runtime.containerd import PrivateContainerd, RuntimeUnavailable
from tests.runtime.hostcaps import crun_v2_blocker

KUBEPODS = "kubepods"
CELLS = [("runc", "v1"), ("runc", "v2"), ("crun", "v1"), ("crun", "v2")]


def _kubepods_dirs() -> list[Path]:
    """Where the runtimes put kubelet's ``/kubepods`` parent: every mounted hierarchy (v1
    controllers, named ones like name=systemd, the v2 one) or the v2 root itself."""
    root = Path("/sys/fs/cgroup")
    return [root / KUBEPODS, *(d / KUBEPODS for d in sorted(root.iterdir()) if d.is_dir())]


def _remove_tree(top: Path) -> None:
    """Empty cgroup directories under ``top``, deepest first (runtimes leave the parents they made)."""
    for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _rmdir(path)
    _rmdir(top)


def _rmdir(path: Path, wait_s: float = 10.0) -> None:
    """A cgroup is busy while a killed container's last process is still exiting, or its shim
    still cleaning up: wait for it (under `make test`'s workers the session may end moments
    after the last container)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:  # its runtime removed it meanwhile
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


@pytest.fixture(scope="session")
def _kubepods_cleanup() -> Iterator[None]:
    existing = {p for p in _kubepods_dirs() if p.exists()}
    yield
    for top in _kubepods_dirs():
        if top.exists() and top not in existing:  # only what this session's containers made
            _remove_tree(top)


@pytest.fixture(scope="session")
def bpf_rules() -> Iterator[BpfDeviceRules]:
    """The agent's v2 device program, compiled once for the session."""
    rules = BpfDeviceRules(NvidiaMajors())
    rules.load()
    yield rules
    rules.close()


@pytest.fixture(scope="session", params=CELLS, ids=[f"{r}-{c}" for r, c in CELLS])
def containerd(request: pytest.FixtureRequest, _kubepods_cleanup: None) -> Iterator[PrivateContainerd]:
    """A started private containerd for one (runtime, cgroup mode) cell of the matrix."""
    runtime_name, cgroup = request.param
    if os.geteuid() != 0:
        pytest.skip("the real-runtime tier needs root (containerd, runc, crun, cgroups)")
    try:
        runtime = PrivateContainerd(
            Path(tempfile.mkdtemp(prefix="vc-ctrd-", dir="/tmp")), runtime=runtime_name, cgroup=cgroup
        )
    except RuntimeUnavailable as err:
        pytest.skip(str(err))
    runtime.start()
    try:
        if (runtime_name, cgroup) == ("crun", "v2"):
            blocker = crun_v2_blocker(runtime)
            if blocker is not None:
                pytest.xfail(blocker)
        yield runtime
    finally:
        runtime.stop()
