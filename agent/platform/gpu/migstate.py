"""What a backend reports of a GPU's MIG side: its mode (current and pending) and its MIG
devices (a GPU instance with one of its compute instances), with the device nodes a
container needs to use one."""

from __future__ import annotations

from dataclasses import dataclass

from agent.platform.gpu.migprofiles import cap_device


@dataclass(frozen=True)
class MigDevice:
    """One MIG device: compute instance ``ci`` of GPU instance ``gi`` on GPU ``gpu_index``."""

    gpu_index: int
    device_index: int  # nvmlDeviceGetMigDeviceHandleByIndex's index
    gi: int  # GPU instance id
    ci: int  # compute instance id within the GI
    uuid: str  # "MIG-..."
    profile: str  # the device's name: "3g.40gb", "1c.3g.40gb" for a CI of part of the GI
    gi_profile: str  # the GPU instance's profile name, "3g.40gb"
    gi_profile_id: int  # 9
    ci_profile_id: int
    placement_start: int  # on the GPU's memory slices
    placement_size: int
    memory_mib: int  # the GI's memory (its CIs share it)
    sm_count: int  # the CI's SMs
    gi_cap_minor: int | None = None  # /dev/nvidia-caps/nvidia-cap<minor> of gpuN/giG/access
    ci_cap_minor: int | None = None  # ... of gpuN/giG/ciC/access

    @property
    def cap_devices(self) -> tuple[str, ...]:
        """The capability device nodes a process needs to run on this device (besides
        /dev/nvidiactl and the parent GPU's node)."""
        return tuple(cap_device(m) for m in (self.gi_cap_minor, self.ci_cap_minor) if m is not None)


@dataclass(frozen=True)
class MigInfo:
    """A GPU's MIG mode and devices. ``pending`` differs from ``current`` between
    ``nvmlDeviceSetMigMode`` and the GPU reset that applies it."""

    capable: bool
    current: bool = False
    pending: bool = False
    devices: tuple[MigDevice, ...] = ()

    @property
    def change_pending(self) -> bool:
        return self.capable and self.current != self.pending


NOT_CAPABLE = MigInfo(capable=False)
