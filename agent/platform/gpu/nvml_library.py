"""Finding and initializing the NVML library: ``libnvidia-ml.so.1`` under a driver root when
pynvml cannot find it by name, and what to tell the user when ``nvmlInit`` fails."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from types import ModuleType

from agent.platform.driverfiles import LIBRARY_DIRS

log = logging.getLogger("agent.platform.gpu.nvml")


def init_hint(nvml: ModuleType, code: int) -> str:
    """Why ``nvmlInit`` failed with NVML code ``code``, and what to do about it."""
    if code in (int(nvml.NVML_ERROR_LIBRARY_NOT_FOUND), int(nvml.NVML_ERROR_DRIVER_NOT_LOADED)):
        return (
            "no NVIDIA driver is visible to the agent. On a GPU node, install the NVIDIA driver "
            "and make sure the container runtime exposes libnvidia-ml.so.1 and /dev/nvidia*; "
            "on a node without GPUs, run the agent with --simulate"
        )
    if code == int(nvml.NVML_ERROR_NO_PERMISSION):
        return "no permission to open /dev/nvidia*; run the agent with access to the GPU devices"
    if code == int(nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH):
        return (
            "the NVML library and the loaded kernel driver differ in version (often after a "
            "driver upgrade without reboot); reboot the node or reload the nvidia module"
        )
    return "NVML could not be initialized"


NVML_LIBRARY = "libnvidia-ml.so.1"


def find_nvml_library(driver_root: Path) -> Path | None:
    """``libnvidia-ml.so.1`` under a driver root as this process sees it (e.g. the host's /
    at /host in a pod under plain runc, where no runtime injected the library)."""
    for directory in LIBRARY_DIRS:
        candidate = driver_root / directory / NVML_LIBRARY
        if candidate.exists():
            return candidate
    return None


def load_from_driver_root(nvml: ModuleType, driver_root: Path) -> bool:
    """Point pynvml at the driver root's NVML (pynvml loads ``nvmlLib`` only while it is None)."""
    library = find_nvml_library(driver_root)
    if library is None or getattr(nvml, "nvmlLib", None) is not None:
        return False
    try:
        setattr(nvml, "nvmlLib", ctypes.CDLL(str(library)))  # noqa: B010  (a module global of pynvml)
    except OSError as err:
        log.warning("cannot load %s: %s", library, err)
        return False
    log.info("NVML loaded from the driver root: %s", library)
    return True
