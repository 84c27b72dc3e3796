"""A container that opens a GPU from its first instruction on and keeps trying, and what
it saw: the device gate's window measured from inside (tests/runtime/test_gate.py,
bench/guard_window.py). Times are /proc/uptime (CLOCK_BOOTTIME, shared with the host;
centiseconds: the shell in the image has no finer clock)."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import CgroupResolver, QosClass, pod_relpath
from tests.runtime.containerd import Container, PrivateContainerd

GPUS = 2
OUT = "/out"
# One line per attempt: "<uptime cs> <how the open ended>" ("No such device or address":
# the device cgroup let it through to a kernel without the driver; "Operation not permitted":
# refused), for ``seconds``, then a "done" file.
PROBE = (
    "read s _ < /proc/uptime; s=${{s%.*}}${{s#*.}}; end=$((s + {centis}))\n"
    "while :; do read t _ < /proc/uptime; t=${{t%.*}}${{t#*.}}; r=$(cat {device} 2>&1)\n"
    '  echo "$t ${{r##*: }}"; [ "$t" -ge "$end" ] && break; done > {out}/probe.log\n'
    "echo done > {out}/done; exec sleep 600\n"
)


def gpu_nodes(containerd: PrivateContainerd) -> tuple[Path, ...]:
    """Host device nodes /dev/nvidia<N> stand-ins (char 195:N; no driver behind them)."""
    directory = containerd.workdir / "dev"
    directory.mkdir(exist_ok=True)
    nodes = tuple(directory / f"nvidia{minor}" for minor in range(GPUS))
    for minor, node in enumerate(nodes):
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    return nodes


def resolver(containerd: PrivateContainerd) -> CgroupResolver:
    return CgroupResolver(containerd.layout(), CgroupDriver.CGROUPFS)


def controller(containerd: PrivateContainerd) -> str:
    return "devices" if containerd.cgroup == "v1" else UNIFIED


def make_pod_cgroup(
    containerd: PrivateContainerd, pod_uid: str, qos: QosClass = QosClass.BEST_EFFORT
) -> Path:
    """The pod's cgroup, made before its containers as kubelet makes it."""
    path = containerd.layout().root_for(controller(containerd)) / pod_relpath(
        CgroupDriver.CGROUPFS, pod_uid, qos
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class ProbeResult:
    attempts: int
    allowed: int  # opens the device cgroup let through
    first_cs: int  # uptime of the first attempt
    last_allowed_cs: int | None

    @property
    def window_ms(self) -> int:
        """From the first attempt to the end of the last successful one (0: none succeeded)."""
        if self.last_allowed_cs is None:
            return 0
        return (self.last_allowed_cs - self.first_cs + 1) * 10


def start_probe(
    containerd: PrivateContainerd,
    pod_uid: str,
    devices: tuple[Path, ...],
    target: str,
    *,
    out: Path,
    seconds: float,
) -> Container:
    out.mkdir(parents=True, exist_ok=True)
    script = PROBE.format(centis=int(seconds * 100), device=target, out=OUT)
    return containerd.run(
        pod_uid=pod_uid, devices=devices, command=("/bin/sh", "-c", script), rw_mounts={out: OUT}
    )


def probe_result(out: Path, timeout_s: float) -> ProbeResult:
    deadline = time.monotonic() + timeout_s
    while not (out / "done").exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the probe did not finish in {timeout_s} s")
        time.sleep(0.05)
    rows = [line.split(" ", 1) for line in (out / "probe.log").read_text().splitlines() if " " in line]
    outcomes = [(int(t), how) for t, how in rows]
    unexpected = {how for _, how in outcomes} - {"No such device or address", "Operation not permitted"}
    assert not unexpected, unexpected
    allowed = [t for t, how in outcomes if how == "No such device or address"]
    return ProbeResult(len(outcomes), len(allowed), outcomes[0][0], max(allowed) if allowed else None)
