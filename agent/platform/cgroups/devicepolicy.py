"""Which NVIDIA device nodes a container may open, independent of how the rule is enforced.

The rules only ever take access away (docs/reference.md, "NVIDIA device nodes" and
"Device rules"):

- a container with GPUs may use its ``/dev/nvidiaN`` (major 195, minor N), ``/dev/nvidiactl``
  (195:255) and the UVM devices (nvidia-uvm, nvidia-uvm-tools: a dynamic major); every
  other minor of 195 (other GPUs, modeset 254) and the nvidia-caps majors are denied;
  other NVIDIA majors (nvswitch, nvlink) are left as they are.
- a container of a pod without GPUs gets no NVIDIA device at all: all of 195 and every
  dynamic major whose name in /proc/devices starts with "nvidia".
- every other device is left alone.

Enforcement lives in ``devices_v1`` (devices.deny) and ``devices_v2`` (a BPF program);
both implement ``DeviceRules``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.errors import PlatformError

NVIDIA_MAJOR = 195  # fixed by the driver (NV_MAJOR_DEVICE_NUMBER)
CTL_MINOR = 255  # /dev/nvidiactl
MODESET_MINOR = 254  # /dev/nvidia-modeset
MAX_GPU_MINOR = 247  # /dev/nvidia0 .. /dev/nvidia247


class GuardError(PlatformError):
    """Device rules could not be read, written, loaded or attached for a cgroup."""


@dataclass(frozen=True)
class NvidiaMajors:
    """The dynamic NVIDIA majors of this boot, from /proc/devices (empty without the driver)."""

    uvm: frozenset[int] = frozenset()  # nvidia-uvm (its minor 1 is nvidia-uvm-tools)
    caps: frozenset[int] = frozenset()  # nvidia-caps, nvidia-caps-imex-channels
    other: frozenset[int] = frozenset()  # nvidia-nvswitch, nvidia-nvlink, ...


def parse_proc_devices(text: str) -> NvidiaMajors:
    """The NVIDIA character majors of a /proc/devices text; 195 itself is always known."""
    uvm: set[int] = set()
    caps: set[int] = set()
    other: set[int] = set()
    in_char = False
    for line in text.splitlines():
        if line.strip().endswith("devices:"):
            in_char = line.startswith("Character")
            continue
        fields = line.split()
        if not in_char or len(fields) != 2 or not fields[0].isdigit():
            continue
        major, name = int(fields[0]), fields[1]
        if major == NVIDIA_MAJOR or not name.startswith("nvidia"):
            continue
        if name.startswith("nvidia-uvm"):
            uvm.add(major)
        elif name.startswith("nvidia-caps"):
            caps.add(major)
        else:
            other.add(major)
    return NvidiaMajors(frozenset(uvm), frozenset(caps), frozenset(other - uvm - caps))


def read_nvidia_majors(proc_root: Path = Path("/proc")) -> NvidiaMajors:
    path = proc_root / "devices"
    try:
        return parse_proc_devices(path.read_text())
    except OSError as err:
        raise GuardError(f"cannot read {path} for the NVIDIA device majors: {err}") from err


@dataclass(frozen=True)
class DevicePolicy:
    """What one container may open; ``gpu_minors`` None means the pod has no GPU."""

    gpu_minors: frozenset[int] | None

    def __post_init__(self) -> None:
        bad = sorted(m for m in self.gpu_minors or () if not 0 <= m <= MAX_GPU_MINOR)
        if bad:
            raise ValueError(f"GPU minor numbers must be 0..{MAX_GPU_MINOR}, got {bad}")

    @property
    def has_gpu(self) -> bool:
        return self.gpu_minors is not None

    def allowed_minors(self) -> frozenset[int]:
        """The minors of major 195 this container keeps."""
        if self.gpu_minors is None:
            return frozenset()
        return self.gpu_minors | {CTL_MINOR}

    def denied_majors(self, majors: NvidiaMajors) -> frozenset[int]:
        """Dynamic majors denied as a whole (major 195 is handled per minor)."""
        if self.gpu_minors is None:
            return majors.uvm | majors.caps | majors.other
        return majors.caps

    def allows(self, major: int, minor: int, majors: NvidiaMajors) -> bool:
        """The reference semantics both enforcers implement."""
        if major == NVIDIA_MAJOR:
            return minor in self.allowed_minors()
        return major not in self.denied_majors(majors)

    def describe(self) -> str:
        if self.gpu_minors is None:
            return "no NVIDIA devices"
        gpus = ",".join(f"/dev/nvidia{m}" for m in sorted(self.gpu_minors)) or "no GPU"
        return f"{gpus} + nvidiactl + uvm only"


class Outcome(enum.StrEnum):
    """What ``DeviceRules.ensure`` did."""

    APPLIED = "applied"  # rules put in place for a cgroup seen for the first time
    UNCHANGED = "unchanged"  # rules verified in place
    REPAIRED = "repaired"  # rules had been undone (a runtime update) and were put back


class DeviceRules(Protocol):
    """One enforcement mechanism (cgroup v1 devices or a v2 BPF program)."""

    controller: str  # the hierarchy it writes to: "devices" or UNIFIED

    def set_majors(self, majors: NvidiaMajors) -> None:
        """The dynamic majors changed (driver loaded or reloaded)."""

    def ensure(self, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        """Make the rules for ``cgroup_dir`` hold; idempotent. Raises GuardError."""

    def planned(self, cgroup_dir: Path, policy: DevicePolicy) -> list[str]:
        """What ``ensure`` would change, as readable lines (for audit mode)."""

    def remove(self, cgroup_dir: Path) -> None:
        """Take back what ``ensure`` did, if the cgroup still exists. Raises GuardError."""

    def denied(self, cgroup_dir: Path) -> int | None:
        """Accesses refused (or counted, in audit) so far; None when the mechanism cannot count."""

    def close(self) -> None: ...
