"""`vcuda-agent demo`'s live act as a user runs it: a real process tree (the demo, its
agent, the watchdog, the workloads in real cgroups). With ``--duration`` it ends by itself;
Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it) leaves no
process, cgroup or frozen workload behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.tree import files_named
from tests.integration.cgroup_trees import real_layout

pytestmark = pytest.mark.privileged


def _cgroup_root(out: Path) -> Path:
    """The demo's container cgroups, as it prints them (other tests may make their own)."""
    found = re.search(r"^cgroups: (\S+)$", out.read_text(errors="replace"), re.MULTILINE)
    assert found, "the demo did not print its cgroup root"
    root = Path(found.group(1))
    v2_root = detect_layout().v2_root
    assert v2_root is not None and root.parent == v2_root
    return root


def _reads(path: Path) -> str:
    """A cgroup file's content, "" once its cgroup is gone (the demo removes them as it goes)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found


def _demo(short_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = short_dir / "demo.out"
    cmd = [sys.executable, "-m", "agent", "demo", "--no-intro", "--workdir", str(short_dir / "w"), *args]
    with out.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _wait_for_text(proc: subprocess.Popen[bytes], out: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"no {text!r} in the demo's output:\n{out.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.2)


def test_the_live_table_runs_for_its_duration_and_shows_every_pod(short_dir: Path) -> None:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    proc, out = _demo(short_dir, "--duration", "20")
    try:
        code = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "metrics: http://127.0.0.1:" in text
    for pod in (
        "cuda-share-50",
        "fixed-30",
        "best-effort-10",
        "leaky-10",
        "burst-40",
        "fixed-50",
        "dra-claim-30",
    ):
        assert f"│{pod}" in text, f"no table row for {pod}:\n{text[-3000:]}"
    assert "killed pid" in text, "the pod over its memory quota was not shown killed"
    # GPU 3 in MIG mode: a row per instance, and the 2g's throughput unchanged by its
    # deep-queue 3g neighbour (the simulated GPU's own accounting: at most 32 of 132 SMs).
    for pod, profile in (("mig-2g-steady", "2g.20gb"), ("mig-3g-deep", "3g.40gb")):
        assert re.search(rf"│{pod} +│ {re.escape(profile)} +│ GI \d+ at \d:\d", text), f"no MIG row for {pod}"
    comparison = r"2g\.20gb throughput ([\d.]+) % of the GPU alone, ([\d.]+) % beside the deep-queue"
    found = re.findall(comparison, text)
    assert found, f"no MIG throughput comparison:\n{text[-3000:]}"
    alone, beside = map(float, found[-1])
    assert abs(alone - beside) <= 3.0 and beside <= 100 * 32 / 132 + 0.5, found[-1]
    assert "watchdog thawed all of them" in text or "watchdog step skipped" in text
    assert not _cgroup_root(out).exists()
    assert not _processes_mentioning(str(short_dir / "w"))


def test_ctrl_c_leaves_no_process_cgroup_or_frozen_workload(short_dir: Path) -> None:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    proc, out = _demo(short_dir)  # no --duration: it would run until interrupted
    try:
        _wait_for_text(proc, out, "admitted pod burst-40", 120)
        root = _cgroup_root(out)
        assert root.is_dir()
        frozen_seen = False
        deadline = time.monotonic() + 30
        while not frozen_seen and time.monotonic() < deadline:  # interrupt while it throttles
            frozen_seen = any(_reads(p) == "1" for p in files_named(root, "cgroup.freeze"))
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text(errors="replace")
    assert code == 130, text[-3000:]
    assert "interrupted" in text
    assert frozen_seen, "no container was frozen before the interrupt: the test proved nothing"
    assert not root.exists(), f"cgroups left behind: {sorted(root.rglob('*'))[:5]}"
    deadline = time.monotonic() + 5  # the watchdog exits once the agent's pipe closes
    while _processes_mentioning(str(short_dir / "w")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_mentioning(str(short_dir / "w"))
