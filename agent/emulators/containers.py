"""A container runtime emulator for simulated nodes: real cgroups, real processes.

For a pod that kubelet admitted, ``start`` creates the container's cgroup where a
Kubernetes node would have it (the cgroupfs or systemd layout, by QoS class) under a
cgroup v2 directory, and starts a ``vcuda-agent sim-workload`` *inside* it: the child
joins the cgroup before it execs, so the agent's process events see it there from its
first instruction. The agent then finds, measures and freezes it exactly as it would a
container made by containerd.

The container gets the environment Allocate handed out (its ``CUDA_*``, ``NVIDIA_*`` and
``VCUDA_*`` variables: the MPS pipe directory and limits among them). With no mount
namespace, a mount is applied by rewriting the variables that point into its container
path to its host path.

Not modelled: images, namespaces (mounts as above), the pause container, restarts, OOM
handling, cgroup controllers (only the v2 directory is made; the freezer needs none).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.paths import QosClass, container_names, pod_relpath
from agent.platform.cgroups.tree import remove_dir

_PASSED = ("CUDA_", "NVIDIA_", "VCUDA_")


@dataclass
class RunningContainer:
    key: str  # namespace/pod/container
    cgroup: Path
    proc: subprocess.Popen[bytes]
    gpu: int = -1  # the simulated GPU index it runs on (-1: not given)

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class ContainerRuntime:
    cgroup_root: Path  # a v2 directory standing for the node's /sys/fs/cgroup
    sim_state_dir: Path
    driver: CgroupDriver = CgroupDriver.CGROUPFS
    containers: list[RunningContainer] = field(default_factory=list)
    _made: list[Path] = field(default_factory=list)

    def start(
        self,
        key: str,
        *,
        pod_uid: str,
        qos: QosClass,
        container_id: str,
        gpu: int,
        busy: float = 1.0,
        memory_mib: int = 0,
        extra: tuple[str, ...] = (),
        command: Sequence[str] | None = None,
        envs: Mapping[str, str] | None = None,
        mounts: Sequence[tuple[str, str]] = (),
        user: int | None = None,
    ) -> RunningContainer:
        """Make the container's cgroup and start a simulated GPU workload in it (or
        ``command``, e.g. a CUDA program on a real GPU); ``user``: the uid (and gid) it runs
        as, as a pod's runAsUser sets it (None: root)."""
        pod_dir = self._mkdirs(self.cgroup_root / pod_relpath(self.driver, pod_uid, qos))
        cgroup = self._mkdirs(pod_dir / container_names(self.driver, container_id)[0])
        procs = cgroup / "cgroup.procs"
        cmd = [sys.executable, "-m", "agent", "sim-workload", "--sim-state-dir", str(self.sim_state_dir)]
        cmd += ["--gpu", str(gpu), "--busy", str(busy), "--memory-mib", str(memory_mib), *extra]
        if command is not None:
            cmd = list(command)

        # A shell joins the cgroup, then execs the workload (same pid): no preexec_fn, so
        # subprocess can vfork and gRPC's fork handlers in this process stay out of it.
        join = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *cmd]
        if user is not None:  # joins as root (cgroup.procs is root's), then drops to the uid
            join[4:4] = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
        proc = subprocess.Popen(join, env={**os.environ, **container_env(envs or {}, mounts)})
        running = RunningContainer(key, cgroup, proc, gpu)
        self.containers.append(running)
        return running

    def stop(self) -> None:
        """Kill every workload (thawing first: a frozen process cannot die) and remove the cgroups."""
        for c in self.containers:
            with contextlib.suppress(OSError):
                (c.cgroup / "cgroup.freeze").write_text("0")
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGCONT)
                c.proc.kill()
            c.proc.wait(timeout=30)  # (a loaded host was seen to take over 10 s)
        for path in sorted(self._made, key=lambda p: len(p.parts), reverse=True):
            remove_cgroup_dir(path)
        self.containers.clear()
        self._made.clear()

    def _mkdirs(self, path: Path) -> Path:
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            self._made.append(p)
        return path


def container_env(envs: Mapping[str, str], mounts: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Allocate's CUDA/NVIDIA/VCUDA variables, with paths inside a mount's container path
    rewritten to its host path (``mounts``: (container path, host path))."""
    out = {}
    for name, value in envs.items():
        if not name.startswith(_PASSED):
            continue
        out[name] = next(
            (
                outside + value[len(inside) :]
                for inside, outside in mounts
                if value == inside or value.startswith(inside.rstrip("/") + "/")
            ),
            value,
        )
    return out


def remove_cgroup_dir(path: Path) -> None:
    """rmdir, retried for 5 s: an exiting process leaves its cgroup a moment after wait()."""
    remove_dir(path, busy_wait_s=5.0)
