"""MPS v3 on newer drivers (r615+ / CUDA 13.4; cgroup routing R620): whether this node has it,
and the namespace commands the agent sends it. docs/reference.md, "Newer drivers: MPS v3 and
memory limits per cgroup"; docs/enforcement.md.

Detection is what NVIDIA documents as the check: ``nvidia-cuda-mps-control -p 3 -h`` lists
the ``server`` and ``namespace`` modules on a driver with MPS v3 (an older one refuses
``-p``), and ``/sys/fs/cgroup/dmem.capacity`` lists one ``nvidia/<pci>/vidmem`` region per
GPU where the kernel's dmem controller (6.14+) limits that GPU's memory per cgroup.
Everything here is UNVERIFIED ON HARDWARE until a lent GPU has an r615+ driver: the lent
GPUs so far run 580, which has neither.

The v3 commands use the documented module-verb form (``namespace create|set|...``); the
option spelling and the cgroup binding verb (:data:`NAMESPACE_COMMANDS`) are ASSUMPTIONS,
kept in this one place to be corrected against ``-p 3 -h`` on such a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL

from agent.errors import MpsCommandError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 5.0
DMEM_CAPACITY = Path("/sys/fs/cgroup/dmem.capacity")
UNVERIFIED = "unverified on hardware until a lent GPU has an r615+ driver"
# ASSUMPTION: the option spelling of the documented verbs, and the cgroup binding verb.
NAMESPACE_COMMANDS = {
    "create": ("namespace", "create", "--name={name}"),
    "percentage": ("namespace", "set", "--name={name}", "--active-thread-percentage={percent}"),
    "memory": ("namespace", "set", "--name={name}", "--pinned-memory-limit={mib}M"),
    "bind": ("namespace", "bind", "--name={name}", "--cgroup={cgroup}"),
    "delete": ("namespace", "delete", "--name={name}"),
}
_PCI = re.compile(r"^(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")

Runner = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class MpsCapability:
    """What this node's driver and kernel offer for MPS limits a tenant cannot lift."""

    v3: bool  # the control daemon speaks protocol 3 (namespaces)
    v3_detail: str  # why not, or what answered
    dmem: Mapping[int, bool] = field(default_factory=dict)  # GPU index -> a dmem region
    verified: bool = False  # seen working on a lent GPU (never yet)

    def describe_gpu(self, gpu: int) -> str:
        """What status says of one GPU."""
        v3 = "yes" if self.v3 else f"no ({self.v3_detail})"
        dmem = "yes" if self.dmem.get(gpu) else "no"
        note = "" if self.verified else f", {UNVERIFIED}"
        return f"MPS v3 namespaces: {v3}; dmem: {dmem}{note}"

    def describe(self) -> str:
        dmem = ", ".join(f"GPU {i} {'yes' if ok else 'no'}" for i, ok in sorted(self.dmem.items()))
        v3 = "yes" if self.v3 else f"no ({self.v3_detail})"
        note = "" if self.verified else f" [{UNVERIFIED}]"
        return f"MPS v3 namespaces: {v3}; dmem: {dmem or 'no GPUs'}{note}"


def client_command(daemon_command: Sequence[str]) -> list[str]:
    """The command-line client of a daemon command (``<program> -f ...`` without ``-f``)."""
    return [w for w in daemon_command if w != "-f"]


def run_control(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    run: Runner | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one control command (no stdin: an older control that ignores the flags must not
    wait in its interactive shell), its output captured. Whatever keeps it from running or
    finishing (missing, not permitted, timed out, a check that failed) is MpsCommandError."""
    try:
        return (run or subprocess.run)(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=None if env is None else dict(env),
            stdin=DEVNULL,
        )
    except subprocess.TimeoutExpired as err:
        raise MpsCommandError(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from err
    except subprocess.CalledProcessError as err:
        raise MpsCommandError(f"{' '.join(argv)}: exited {err.returncode}") from err
    except (OSError, subprocess.SubprocessError) as err:  # FileNotFoundError, PermissionError, ...
        raise MpsCommandError(f"{' '.join(argv)}: {err}") from err


def probe_v3(daemon_command: Sequence[str], run: Runner | None = None) -> tuple[bool, str]:
    """Whether ``<program> -p 3 -h`` lists the server and namespace modules; why not."""
    if not daemon_command:
        return False, "no MPS control daemon command is configured"
    argv = [*client_command(daemon_command), "-p", "3", "-h"]
    try:
        done = run_control(argv, timeout_s=PROBE_TIMEOUT_S, run=run)
    except MpsCommandError as err:
        return False, str(err)
    text = f"{done.stdout}\n{done.stderr}"
    words = set(re.findall(r"[a-z_]+", text.lower()))
    if done.returncode == 0 and {"server", "namespace"} <= words:
        return True, "-p 3 -h lists server and namespace"
    return False, f"-p 3 -h exited {done.returncode} without the server and namespace modules"


def normal_pci(bus_id: str) -> str | None:
    """``00000000:3B:00.0`` (NVML) and ``0000:3b:00.0`` (sysfs) alike: ``0000:3b:00.0``."""
    match = _PCI.match(bus_id.strip().lower())
    if match is None:
        return None
    domain = int(match.group(1) or "0", 16)
    return f"{domain:04x}:{match.group(2)}:{match.group(3)}.{match.group(4)}"


def probe_dmem(pci_by_gpu: Mapping[int, str], capacity: Path = DMEM_CAPACITY) -> dict[int, bool]:
    """Per GPU: whether the dmem controller lists ``nvidia/<pci>/vidmem`` for it."""
    try:
        lines = capacity.read_text(errors="replace").splitlines()
    except OSError:
        return dict.fromkeys(pci_by_gpu, False)
    regions = set()
    for line in lines[:4096]:
        name = line.split(maxsplit=1)[0] if line.strip() else ""
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "nvidia" and parts[2] == "vidmem":
            pci = normal_pci(parts[1])
            if pci is not None:
                regions.add(pci)
    return {gpu: normal_pci(pci) in regions for gpu, pci in pci_by_gpu.items()}


def detect(
    daemon_command: Sequence[str],
    pci_by_gpu: Mapping[int, str],
    *,
    run: Runner | None = None,
    capacity: Path = DMEM_CAPACITY,
) -> MpsCapability:
    v3, detail = probe_v3(daemon_command, run)
    return MpsCapability(v3, detail, probe_dmem(pci_by_gpu, capacity))


def namespace_name(pod_uid: str, container: str) -> str:
    """A namespace per share: short, of safe characters, the same for the same share."""
    digest = hashlib.sha256(f"{pod_uid}/{container}".encode()).hexdigest()[:16]
    return f"vcuda-{digest}"


def namespace_commands(
    name: str, percent: int, memory_mib: int | None, cgroup: Path | None
) -> list[list[str]]:
    """The commands that give ``name`` these limits (and bind ``cgroup`` to it, when known)."""
    values = {"name": name, "percent": str(percent), "mib": str(memory_mib), "cgroup": str(cgroup)}
    steps = ["create", "percentage"] + (["memory"] if memory_mib else []) + (["bind"] if cgroup else [])
    return [[w.format(**values) for w in NAMESPACE_COMMANDS[s]] for s in steps]


def send(
    daemon_command: Sequence[str],
    pipe_dir: Path,
    words: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    run: Runner | None = None,
) -> str | None:
    """Run one v3 command against the daemon at ``pipe_dir`` (``environ``: the agent's own
    environment when None); why it failed (None: done)."""
    argv = [*client_command(daemon_command), "-p", "3", *words]
    env = {**(os.environ if environ is None else environ), "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    try:
        done = run_control(argv, timeout_s=COMMAND_TIMEOUT_S, env=env, run=run)
    except MpsCommandError as err:
        return f"{' '.join(words)}: {err.__cause__ or err}"
    out = (done.stdout or "").strip()
    if done.returncode != 0 or out.startswith("Error"):
        why = out or (done.stderr or "").strip()
        return f"{' '.join(words)}: exited {done.returncode}: {why[:200]}"
    return None
