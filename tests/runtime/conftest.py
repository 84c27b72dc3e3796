"""The real-runtime tier: a private containerd per session (never the system's), runc as
its runtime. Skips, with the reason, where the binaries or cgroups are missing; on CI
(``VCUDA_REQUIRE_PRIVILEGED=1``) such a skip fails the run like every privileged test's."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.containerd import PrivateContainerd, RuntimeUnavailable

KUBEPODS = "kubepods"


def _kubepods_dirs() -> list[Path]:
    """Where runc puts kubelet's ``/kubepods`` parent: every mounted hierarchy (v1 controllers,
    named ones like name=systemd, the v2 one) or the v2 root itself."""
    root = Path("/sys/fs/cgroup")
    return [root / KUBEPODS, *(d / KUBEPODS for d in sorted(root.iterdir()) if d.is_dir())]


def _remove_tree(top: Path) -> None:
    """Empty cgroup directories under ``top``, deepest first (runc leaves the parents it made)."""
    for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        path.rmdir()
    top.rmdir()


@pytest.fixture(scope="session")
def containerd() -> Iterator[PrivateContainerd]:
    if os.geteuid() != 0:
        pytest.skip("the real-runtime tier needs root (containerd, runc, cgroups)")
    try:
        runtime = PrivateContainerd(Path(tempfile.mkdtemp(prefix="vc-ctrd-", dir="/tmp")))
    except RuntimeUnavailable as err:
        pytest.skip(str(err))
    existing = {p for p in _kubepods_dirs() if p.exists()}
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()
        for top in _kubepods_dirs():
            if top.exists() and top not in existing:  # only what this session's containers made
                _remove_tree(top)
