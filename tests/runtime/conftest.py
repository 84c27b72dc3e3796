"""The real-runtime tier: a private containerd per runtime and cgroup mode (never the
system's). Skips, with the reason, where the binaries or root are missing; on CI
(``VCUDA_REQUIRE_PRIVILEGED=1``) such a skip fails the run like every privileged test's."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.platform.cgroups.devicepolicy import NvidiaMajors
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.tree import remove_tree
from tests.runtime.containerd import PrivateContainerd, RuntimeUnavailable
from tests.runtime.hostcaps import crun_v2_blocker

KUBEPODS = "kubepods"
CELLS = [("runc", "v1"), ("runc", "v2"), ("crun", "v1"), ("crun", "v2")]


def _kubepods_dirs() -> list[Path]:
    """Where the runtimes put kubelet's ``/kubepods`` parent: every mounted hierarchy (v1
    controllers, named ones like name=systemd, the v2 one) or the v2 root itself."""
    root = Path("/sys/fs/cgroup")
    return [root / KUBEPODS, *(d / KUBEPODS for d in sorted(root.iterdir()) if d.is_dir())]


@pytest.fixture(scope="session")
def _kubepods_cleanup() -> Iterator[None]:
    existing = {p for p in _kubepods_dirs() if p.exists()}
    yield
    for top in _kubepods_dirs():
        if top.exists() and top not in existing:  # only what this session's containers made
            remove_tree(top)  # tolerates cgroups their runtime removes meanwhile


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
    workdir = Path(tempfile.mkdtemp(prefix="vc-ctrd-", dir="/tmp"))
    try:
        runtime = PrivateContainerd(workdir, runtime=runtime_name, cgroup=cgroup)
    except RuntimeUnavailable as err:
        shutil.rmtree(workdir)
        pytest.skip(str(err))
    try:
        runtime.start()
        if (runtime_name, cgroup) == ("crun", "v2"):
            blocker = crun_v2_blocker(runtime)
            if blocker is not None:
                pytest.xfail(blocker)
        yield runtime
    finally:
        runtime.stop()
        _remove_workdir(workdir)


def _remove_workdir(workdir: Path) -> None:
    """The cell's images, snapshots and logs (about 6 MB): the suite leaves nothing in /tmp.
    Its snapshot mounts lived only in containerd's private mount namespace, gone with it."""
    try:
        shutil.rmtree(workdir)
    except OSError as err:  # a teardown that cannot tidy must not hide the tests' result
        warnings.warn(f"could not remove {workdir}: {err}", stacklevel=1)
