"""NVML's MIG write calls: the MIG mode, and GPU instances with their compute instance.

Written once against pynvml's names and signatures, for both backends: the NVML backend
hands it pynvml, its device handles and its error boundary (``NVMLError`` raised as the
agent's ``NvmlError``/``GpuLostError`` ``from`` pynvml's); the simulated backend hands it
the GPU server's client (:class:`~agent.platform.gpu.sim.migclient.SimNvml`: GPU indexes
as handles, errors already the agent's). A call the driver refuses raises
``MigChangeError`` naming the GPU, what was asked and NVML's reason, from the NVML error.

- ``nvmlDeviceSetMigMode``: its activation status tells whether the new mode is pending
  until a GPU reset (``NVML_ERROR_RESET_REQUIRED``) or current at once.
- A GPU instance is created at an explicit placement
  (``nvmlDeviceCreateGpuInstanceWithPlacement``, with the profile id that
  ``nvmlDeviceGetGpuInstanceProfileInfo`` gives for the profile's index), then its compute
  instance (``nvmlGpuInstanceGetComputeInstanceProfileInfo`` + ``nvmlGpuInstanceCreateComputeInstance``);
  if the compute instance fails the GPU instance is destroyed again.
- Destroying: the compute instances first (``nvmlComputeInstanceDestroy``), then the GPU
  instance (``nvmlGpuInstanceDestroy``).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from agent.errors import GpuError, MigChangeError
from agent.platform.gpu.migprofiles import ComputeInstanceProfile, GpuInstanceProfile, Placement
from agent.platform.gpu.nvmlcodes import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_RESET_REQUIRED,
)

log = logging.getLogger(__name__)

_ENGINE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED

Boundary = Callable[[int], AbstractContextManager[None]]  # translates NVML's errors for GPU n


def pynvml_placement(nvml: Any) -> Callable[[Placement], Any]:
    """How pynvml takes a placement: a pointer to a ``c_nvmlGpuInstancePlacement_t`` (the
    pointer keeps the structure alive)."""
    return lambda p: ctypes.byref(nvml.c_nvmlGpuInstancePlacement_t(p.start, p.size))


class MigControl:
    """The MIG writes on one node's GPUs (see the module docstring)."""

    def __init__(
        self,
        nvml: Any,
        handle: Callable[[int], Any],
        boundary: Boundary,
        placement: Callable[[Placement], Any] = lambda p: p,
    ) -> None:
        """``placement``: a placement as the binding takes it (pynvml: a pointer to a
        ``c_nvmlGpuInstancePlacement_t``)."""
        self._nvml = nvml
        self._handle = handle
        self._boundary = boundary
        self._placement = placement

    def set_mode(self, index: int, enabled: bool) -> bool:
        """MIG mode on or off; True when the change waits for a GPU reset."""
        mode = NVML_DEVICE_MIG_ENABLE if enabled else NVML_DEVICE_MIG_DISABLE
        with self._refused(index, f"MIG mode {'on' if enabled else 'off'}"):
            status = self._nvml.nvmlDeviceSetMigMode(self._handle(index), mode)
        return int(status) == NVML_ERROR_RESET_REQUIRED

    def create(
        self, index: int, profile: GpuInstanceProfile, placement: Placement, ci: ComputeInstanceProfile
    ) -> tuple[int, int]:
        """A GPU instance of ``profile`` at ``placement`` with compute instance ``ci``;
        (GI id, CI id)."""
        nvml = self._nvml
        with self._refused(index, f"a {profile.name} GPU instance at {placement}"):
            handle = self._handle(index)
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile.index)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, self._placement(placement))
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
        try:
            with self._refused(index, f"the {ci.name} compute instance of GPU instance {gi_id}"):
                ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci.index, _ENGINE_SHARED)
                ci_handle = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
                ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci_handle).id)
        except MigChangeError:
            self.destroy(index, gi_id, ())
            raise
        log.info("GPU %d: created %s (GPU instance %d at %s, compute instance %d)", index, ci.name, gi_id,
                 placement, ci_id)  # fmt: skip
        return gi_id, ci_id

    def destroy(self, index: int, gi: int, cis: Iterable[int]) -> None:
        """Compute instances ``cis`` of GPU instance ``gi``, then the GPU instance."""
        nvml = self._nvml
        with self._refused(index, f"destroying GPU instance {gi}"):
            gi_handle = nvml.nvmlDeviceGetGpuInstanceById(self._handle(index), gi)
            for ci in cis:
                nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi_handle, ci))
            nvml.nvmlGpuInstanceDestroy(gi_handle)
        log.info("GPU %d: destroyed GPU instance %d", index, gi)

    @contextmanager
    def _refused(self, index: int, what: str) -> Iterator[None]:
        """The backend's boundary, and its ``GpuError`` raised as ``MigChangeError``."""
        try:
            with self._boundary(index):
                yield
        except GpuError as err:
            raise MigChangeError(f"GPU {index}: the driver refused {what}: {err}") from err
