"""One simulated GPU's MIG side, as NVIDIA's driver keeps it: the mode (current, and the
pending one that a GPU reset applies), the GPU instances on their placements and the
compute instances in them, with NVML's errors for what the driver refuses.

Rules (docs/mig.md): a mode change needs no process on the GPU and waits, pending, for a
GPU reset; disabling needs no instance left. Instances need the mode on; a GI needs a free
placement of its profile and room under the profile's instance count
(INSUFFICIENT_RESOURCES otherwise); a CI likewise within its GI; nothing in use is
destroyed (IN_USE: processes on a CI, CIs in a GI). Who is busy is the caller's to say.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from agent.platform.gpu.migprofiles import (
    MAX_CI_PER_GI,
    ComputeInstanceProfile,
    GpuInstanceProfile,
    MigProduct,
    Placement,
    choose_placement,
    ci_cap_minor,
    ci_profiles,
    free_placements,
    gi_cap_minor,
    gpu_instance_id,
    remaining_capacity,
)
from agent.platform.gpu.migstate import MigDevice, MigInfo
from agent.platform.gpu.nvmlcodes import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
    error_name,
)
from agent.platform.gpu.sim.replies import RequestError

_MIG_NAMESPACE = uuid.UUID("2b1f7c64-95a4-4d0e-8c3a-5e0b7a9d41c6")


class MigError(RequestError):
    """What NVML returns for a refused MIG call: ``code`` is the NVML_ERROR_* value."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(f"{message} ({error_name(code)})")


def mig_uuid(gpu_uuid: str, gi: int, ci: int) -> str:
    """A MIG device's UUID, the same for the same GPU and instance ids."""
    return "MIG-" + str(uuid.uuid5(_MIG_NAMESPACE, f"{gpu_uuid}/{gi}/{ci}"))


@dataclass
class ComputeInstance:
    id: int
    profile: ComputeInstanceProfile
    placement: Placement
    uuid: str


@dataclass
class GpuInstance:
    id: int
    profile: GpuInstanceProfile
    placement: Placement
    cis: dict[int, ComputeInstance] = field(default_factory=dict)


class MigGpu:
    """The MIG state of GPU ``index`` (see the module docstring); ``product`` None: a GPU
    without MIG, on which every MIG call is NOT_SUPPORTED."""

    def __init__(self, index: int, minor: int, gpu_uuid: str, product: MigProduct | None) -> None:
        self.index = index
        self.minor = minor
        self.gpu_uuid = gpu_uuid
        self.product = product
        self.current = False
        self.pending = False
        self.gis: dict[int, GpuInstance] = {}

    # Mode -----------------------------------------------------------------------------------
    def require_capable(self) -> MigProduct:
        if self.product is None:
            raise MigError(NVML_ERROR_NOT_SUPPORTED, f"GPU {self.index} does not support MIG")
        return self.product

    def require_enabled(self) -> MigProduct:
        gpu = self.require_capable()
        if not self.current:
            pending = " (enabled, pending a GPU reset)" if self.pending else ""
            raise MigError(NVML_ERROR_NOT_SUPPORTED, f"GPU {self.index} is not in MIG mode{pending}")
        return gpu

    def set_mode(self, mode: int, busy: str | None) -> int:
        """``nvmlDeviceSetMigMode``: the activation status (RESET_REQUIRED: pending until the
        GPU is reset)."""
        self.require_capable()
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise MigError(NVML_ERROR_INVALID_ARGUMENT, f"MIG mode must be 0 or 1, got {mode!r}")
        if busy is not None:
            raise MigError(NVML_ERROR_IN_USE, f"GPU {self.index}: cannot change the MIG mode: {busy}")
        if mode == NVML_DEVICE_MIG_DISABLE and self.gis:
            raise MigError(
                NVML_ERROR_IN_USE,
                f"GPU {self.index}: cannot disable MIG while GPU instances {sorted(self.gis)} exist",
            )
        self.pending = mode == NVML_DEVICE_MIG_ENABLE
        return NVML_SUCCESS if self.pending == self.current else NVML_ERROR_RESET_REQUIRED

    def reset(self, busy: str | None) -> list[str]:
        """A GPU reset: the pending mode becomes current and every instance is gone (MIG
        devices do not survive a reset); the UUIDs of the devices that went."""
        if busy is not None:
            raise MigError(NVML_ERROR_IN_USE, f"GPU {self.index}: cannot reset: {busy}")
        gone = [ci.uuid for gi in self.gis.values() for ci in gi.cis.values()]
        self.gis.clear()
        self.current = self.pending
        return gone

    # GPU instances --------------------------------------------------------------------------
    def profile(self, index: int) -> GpuInstanceProfile:
        """``nvmlDeviceGetGpuInstanceProfileInfo`` by NVML_GPU_INSTANCE_PROFILE_* index."""
        gpu = self.require_capable()
        if not isinstance(index, int) or not 0 <= index < 0x12:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT, f"no GPU instance profile index {index!r}")
        found = gpu.by_index(index)
        if found is None:
            raise MigError(NVML_ERROR_NOT_SUPPORTED, f"{gpu.key} has no GPU instance profile {index}")
        return found

    def profile_by_id(self, profile_id: int) -> GpuInstanceProfile:
        gpu = self.require_capable()
        found = gpu.by_id(profile_id) if isinstance(profile_id, int) else None
        if found is None:
            known = ", ".join(f"{p.id} ({p.name})" for p in gpu.profiles)
            raise MigError(
                NVML_ERROR_INVALID_ARGUMENT,
                f"{gpu.key} has no GPU instance profile id {profile_id!r} (profiles: {known})",
            )
        return found

    def placements(self, profile_id: int) -> tuple[Placement, ...]:
        """``nvmlDeviceGetGpuInstancePossiblePlacements``: all of them, taken or not, MIG mode
        on or not."""
        return self.profile_by_id(profile_id).placements

    def remaining(self, profile_id: int) -> int:
        self.require_enabled()
        return remaining_capacity(self.profile_by_id(profile_id), self._existing())

    def create_gi(self, profile_id: int, placement: Placement | None = None) -> GpuInstance:
        gpu = self.require_enabled()
        profile = self.profile_by_id(profile_id)
        existing = self._existing()
        if placement is None:
            chosen = choose_placement(gpu, profile, existing)
        else:
            if placement not in profile.placements:
                raise MigError(
                    NVML_ERROR_INVALID_ARGUMENT,
                    f"{profile.name} cannot be placed at {placement}; its placements are "
                    f"{', '.join(map(str, profile.placements))}",
                )
            chosen = placement if placement in free_placements(profile, (p for _, p in existing)) else None
            if chosen is not None and remaining_capacity(profile, existing) == 0:
                chosen = None
        if chosen is None:
            where = "" if placement is None else f" at {placement}"
            raise MigError(
                NVML_ERROR_INSUFFICIENT_RESOURCES,
                f"GPU {self.index}: no room for {profile.name}{where} beside {self._describe()}",
            )
        gi_id = gpu_instance_id(chosen, self.gis)
        if gi_id is None:
            raise MigError(NVML_ERROR_INSUFFICIENT_RESOURCES, f"GPU {self.index}: no free GPU instance id")
        instance = GpuInstance(gi_id, profile, chosen)
        self.gis[gi_id] = instance
        return instance

    def gi(self, gi_id: int) -> GpuInstance:
        self.require_enabled()
        found = self.gis.get(gi_id) if isinstance(gi_id, int) else None
        if found is None:
            raise MigError(NVML_ERROR_NOT_FOUND, f"GPU {self.index} has no GPU instance {gi_id!r}")
        return found

    def destroy_gi(self, gi_id: int) -> None:
        instance = self.gi(gi_id)
        if instance.cis:
            raise MigError(
                NVML_ERROR_IN_USE,
                f"GPU {self.index} GPU instance {gi_id} still has compute instances {sorted(instance.cis)}",
            )
        del self.gis[gi_id]

    # Compute instances ----------------------------------------------------------------------
    def ci_profile(self, gi_id: int, index: int) -> ComputeInstanceProfile:
        """``nvmlGpuInstanceGetComputeInstanceProfileInfo`` by NVML_COMPUTE_INSTANCE_PROFILE_*."""
        instance = self.gi(gi_id)
        if not isinstance(index, int) or not 0 <= index < 0x9:
            raise MigError(NVML_ERROR_INVALID_ARGUMENT, f"no compute instance profile index {index!r}")
        found = next((c for c in self._ci_profiles(instance) if c.index == index), None)
        if found is None:
            raise MigError(
                NVML_ERROR_NOT_SUPPORTED, f"a {instance.profile.name} GPU instance has no CI profile {index}"
            )
        return found

    def ci_remaining(self, gi_id: int, profile_id: int) -> int:
        instance = self.gi(gi_id)
        profile = self.ci_profile(gi_id, profile_id)
        taken = [ci.placement for ci in instance.cis.values()]
        same = sum(1 for ci in instance.cis.values() if ci.profile.index == profile.index)
        free = [p for p in profile.placements if not any(p.overlaps(t) for t in taken)]
        return max(0, min(profile.instance_count - same, len(free)))

    def create_ci(self, gi_id: int, profile_id: int, placement: Placement | None = None) -> ComputeInstance:
        instance = self.gi(gi_id)
        profile = self.ci_profile(gi_id, profile_id)
        if placement is not None and placement not in profile.placements:
            raise MigError(
                NVML_ERROR_INVALID_ARGUMENT,
                f"{profile.name} cannot be placed at {placement}; its placements are "
                f"{', '.join(map(str, profile.placements))}",
            )
        taken = [ci.placement for ci in instance.cis.values()]
        free = [p for p in profile.placements if not any(p.overlaps(t) for t in taken)]
        if placement is not None:
            free = [p for p in free if p == placement]
        ci_id = next((i for i in range(MAX_CI_PER_GI) if i not in instance.cis), None)
        if not free or ci_id is None or self.ci_remaining(gi_id, profile_id) == 0:
            raise MigError(
                NVML_ERROR_INSUFFICIENT_RESOURCES,
                f"GPU {self.index} GPU instance {gi_id}: no room for {profile.name}",
            )
        ci = ComputeInstance(ci_id, profile, free[0], mig_uuid(self.gpu_uuid, gi_id, ci_id))
        instance.cis[ci_id] = ci
        return ci

    def ci(self, gi_id: int, ci_id: int) -> ComputeInstance:
        instance = self.gi(gi_id)
        found = instance.cis.get(ci_id) if isinstance(ci_id, int) else None
        if found is None:
            raise MigError(NVML_ERROR_NOT_FOUND, f"GPU {self.index} GPU instance {gi_id} has no CI {ci_id!r}")
        return found

    def destroy_ci(self, gi_id: int, ci_id: int, busy: str | None) -> ComputeInstance:
        ci = self.ci(gi_id, ci_id)
        if busy is not None:
            raise MigError(NVML_ERROR_IN_USE, f"GPU {self.index} GPU instance {gi_id} CI {ci_id}: {busy}")
        del self.gis[gi_id].cis[ci_id]
        return ci

    # Views ----------------------------------------------------------------------------------
    def device_list(self) -> list[tuple[GpuInstance, ComputeInstance]]:
        """The MIG devices in NVML's index order (by GI id, then CI id)."""
        return [(gi, gi.cis[c]) for _, gi in sorted(self.gis.items()) for c in sorted(gi.cis)]

    def device(self, gi: GpuInstance, ci: ComputeInstance, index: int) -> MigDevice:
        return MigDevice(
            gpu_index=self.index,
            device_index=index,
            gi=gi.id,
            ci=ci.id,
            uuid=ci.uuid,
            profile=ci.profile.name,
            gi_profile=gi.profile.name,
            gi_profile_id=gi.profile.id,
            ci_profile_id=ci.profile.index,
            placement_start=gi.placement.start,
            placement_size=gi.placement.size,
            memory_mib=gi.profile.memory_mib,
            sm_count=ci.profile.sm_count,
            gi_cap_minor=gi_cap_minor(self.minor, gi.id),
            ci_cap_minor=ci_cap_minor(self.minor, gi.id, ci.id),
        )

    def info(self) -> MigInfo:
        if self.product is None:
            return MigInfo(capable=False)
        devices = tuple(self.device(gi, ci, i) for i, (gi, ci) in enumerate(self.device_list()))
        return MigInfo(True, self.current, self.pending, devices if self.current else ())

    def _ci_profiles(self, instance: GpuInstance) -> tuple[ComputeInstanceProfile, ...]:
        return ci_profiles(instance.profile, self.require_capable())

    def _existing(self) -> list[tuple[GpuInstanceProfile, Placement]]:
        return [(gi.profile, gi.placement) for gi in self.gis.values()]

    def _describe(self) -> str:
        if not self.gis:
            return "nothing"
        return ", ".join(f"{gi.profile.name} at {gi.placement}" for _, gi in sorted(self.gis.items()))
