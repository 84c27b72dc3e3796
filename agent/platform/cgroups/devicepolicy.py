"""Which NVIDIA device nodes a container may open, independent of how the rule is enforced.

The rules only ever take access away (docs/reference.md, "NVIDIA device nodes" and
"Device rules"):

- a container with GPUs may use its ``/dev/nvidiaN`` (major 195, minor N), ``/dev/nvidiactl``
  (195:255) and the UVM devices (nvidia-uvm, nvidia-uvm-tools: a dynamic major); every
  other minor of 195 (other GPUs, modeset 254) and the nvidia-caps majors are denied,
  except, for a container with MIG devices, exactly their capability nodes
  (``/dev/nvidia-caps/nvidia-cap<minor>`` of each device's GPU instance and compute
  instance: ``cap_minors``, of the major named ``nvidia-caps``); other NVIDIA majors
  (nvswitch, nvlink) are left as they are.
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
from agent.platform.gpu.migprofiles import gi_cap_minor

NVIDIA_MAJOR = 195  # fixed by the driver (NV_MAJOR_DEVICE_NUMBER)
CTL_MINOR = 255  # /dev/nvidiactl
MODESET_MINOR = 254  # /dev/nvidia-modeset
MAX_GPU_MINOR = 247  # /dev/nvidia0 .. /dev/nvidia247
MAX_CAP_MINOR = (1 << 20) - 1  # a minor number's range


class GuardError(PlatformError):
    """Device rules could not be read, written, loaded or attached for a cgroup."""


@dataclass(frozen=True)
class NvidiaMajors:
    """The dynamic NVIDIA majors of this boot, from /proc/devices (empty without the driver)."""

    uvm: frozenset[int] = frozenset()  # nvidia-uvm (its minor 1 is nvidia-uvm-tools)
    caps: frozenset[int] = frozenset()  # nvidia-caps, nvidia-caps-imex-channels
    other: frozenset[int] = frozenset()  # nvidia-nvswitch, nvidia-nvlink, ...
    mig_caps: frozenset[int] = frozenset()  # nvidia-caps itself (of caps): the MIG capability nodes


def parse_proc_devices(text: str) -> NvidiaMajors:
    """The NVIDIA character majors of a /proc/devices text; 195 itself is always known."""
    uvm: set[int] = set()
    caps: set[int] = set()
    other: set[int] = set()
    mig_caps: set[int] = set()
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
            if name == "nvidia-caps":
                mig_caps.add(major)
        else:
            other.add(major)
    return NvidiaMajors(frozenset(uvm), frozenset(caps), frozenset(other - uvm - caps), frozenset(mig_caps))


def read_nvidia_majors(proc_root: Path = Path("/proc")) -> NvidiaMajors:
    path = proc_root / "devices"
    try:
        return parse_proc_devices(path.read_text())
    except OSError as err:
        raise GuardError(f"cannot read {path} for the NVIDIA device majors: {err}") from err


@dataclass(frozen=True)
class DevicePolicy:
    """What one container may open; ``gpu_minors`` None means the pod has no GPU;
    ``cap_minors``: the nvidia-caps minors of its MIG devices (only with GPUs)."""

    gpu_minors: frozenset[int] | None
    cap_minors: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        bad = sorted(m for m in self.gpu_minors or () if not 0 <= m <= MAX_GPU_MINOR)
        if bad:
            raise ValueError(f"GPU minor numbers must be 0..{MAX_GPU_MINOR}, got {bad}")
        if self.cap_minors and self.gpu_minors is None:
            raise ValueError("nvidia-caps minors without a GPU: a MIG device needs its parent GPU")
        if any(not 0 <= m <= MAX_CAP_MINOR for m in self.cap_minors):
            raise ValueError(f"nvidia-caps minors must be 0..{MAX_CAP_MINOR}, got {sorted(self.cap_minors)}")

    @property
    def has_gpu(self) -> bool:
        return self.gpu_minors is not None

    def allowed_minors(self) -> frozenset[int]:
        """The minors of major 195 this container keeps."""
        if self.gpu_minors is None:
            return frozenset()
        return self.gpu_minors | {CTL_MINOR}

    def per_minor_caps(self, majors: NvidiaMajors) -> frozenset[int]:
        """The nvidia-caps majors handled minor by minor (those with ``cap_minors``)."""
        return majors.mig_caps if self.cap_minors else frozenset()

    def denied_majors(self, majors: NvidiaMajors) -> frozenset[int]:
        """Dynamic majors denied as a whole (major 195, and nvidia-caps for a container
        with MIG devices, are handled per minor)."""
        if self.gpu_minors is None:
            return majors.uvm | majors.caps | majors.other
        return majors.caps - self.per_minor_caps(majors)

    def caps_bound(self) -> int:
        """One past the last nvidia-caps minor of the container's GPUs (what a per-minor
        deny list has to cover: the capability nodes of GPUs above are of no use without
        their /dev/nvidiaN, which stays denied)."""
        top = max(self.gpu_minors or (0,))
        return gi_cap_minor(top + 1, 0) if top < MAX_GPU_MINOR else MAX_CAP_MINOR + 1

    def allows(self, major: int, minor: int, majors: NvidiaMajors) -> bool:
        """The reference semantics both enforcers implement."""
        if major == NVIDIA_MAJOR:
            return minor in self.allowed_minors()
        if major in self.per_minor_caps(majors):
            return minor in self.cap_minors
        return major not in self.denied_majors(majors)

    def describe(self) -> str:
        if self.gpu_minors is None:
            return "no NVIDIA devices"
        gpus = ",".join(f"/dev/nvidia{m}" for m in sorted(self.gpu_minors)) or "no GPU"
        caps = "".join(f" + nvidia-cap{m}" for m in sorted(self.cap_minors))
        return f"{gpus} + nvidiactl + uvm{caps} only"


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
