"""Kubepods-like trees in this machine's real cgroup hierarchies, and processes to put in them.

Every tree lives under a unique ``vcuda-test-<hex>`` directory in each hierarchy and is
removed (processes killed, directories removed deepest first) even when a test fails.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.emulators.containers import remove_cgroup_dir
from agent.platform.cgroups.layout import UNIFIED, CgroupLayout, CgroupMode, detect_layout

# Reads paths on stdin, one per line, and answers with the errno of opening each (0: opened).
PROBE_SCRIPT = """
import os, sys
while True:
    line = sys.stdin.readline()
    if not line:
        break
    try:
        os.close(os.open(line.strip(), os.O_RDWR))
        print(0, flush=True)
    except OSError as err:
        print(err.errno, flush=True)
"""


@dataclass
class Prober:
    """A child process that opens device nodes on request, from whatever cgroup it was put in."""

    proc: subprocess.Popen[str]

    @classmethod
    def start(cls) -> Prober:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def join(self, cgroup_dir: Path) -> None:
        """Move the child into ``cgroup_dir``; it opens nothing before this returns."""
        (cgroup_dir / "cgroup.procs").write_text(str(self.pid))

    def open_errno(self, path: Path) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the probe process died (exit code {self.proc.poll()})"
        return int(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@dataclass
class CgroupTree:
    """Test directories in the real hierarchies, with a layout rooted at them."""

    layout: CgroupLayout
    created: list[Path] = field(default_factory=list)
    children: list[subprocess.Popen[str]] = field(default_factory=list)
    probers: list[Prober] = field(default_factory=list)

    def root(self, controller: str = UNIFIED) -> Path:
        return self.layout.root_for(controller)

    def mkdir(self, controller: str, relpath: str | Path) -> Path:
        """Create ``relpath`` (and its parents) under the test root of ``controller``."""
        path = self.root(controller)
        for part in Path(relpath).parts:
            path = path / part
            if not path.exists():
                path.mkdir()
                self.created.append(path)
        return path

    def sleeper(self) -> subprocess.Popen[str]:
        child = subprocess.Popen(["sleep", "60"], text=True)
        self.children.append(child)
        return child

    def prober(self) -> Prober:
        prober = Prober.start()
        self.probers.append(prober)
        return prober

    def cleanup(self) -> None:
        for prober in self.probers:
            prober.stop()
        for child in self.children:
            child.kill()
            child.wait(timeout=10)
        for path in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            remove_cgroup_dir(path)


def real_layout() -> CgroupLayout:
    """This machine's layout; skips when the facilities the tests need are genuinely absent."""
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    layout = detect_layout()
    if layout.v2_root is None or "devices" not in layout.v1_roots or "freezer" not in layout.v1_roots:
        pytest.skip(f"needs cgroup v2 plus the v1 devices and freezer controllers (hybrid); found {layout}")
    return layout


@contextmanager
def cgroup_tree() -> Iterator[CgroupTree]:
    """A fresh ``vcuda-test-<hex>`` root in the v2 hierarchy and in the v1 devices and freezer ones."""
    real = real_layout()
    name = f"vcuda-test-{secrets.token_hex(4)}"
    v1_roots = {c: real.root_for(c) / name for c in ("devices", "freezer")}
    tree = CgroupTree(CgroupLayout(CgroupMode.HYBRID, real.root_for(UNIFIED) / name, v1_roots))
    for root in [tree.layout.v2_root, *tree.layout.v1_roots.values()]:
        assert root is not None
        root.mkdir()
        tree.created.append(root)
    try:
        yield tree
    finally:
        tree.cleanup()
