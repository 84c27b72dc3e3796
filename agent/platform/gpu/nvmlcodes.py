"""NVML's return codes and MIG constants, as ``nvml.h`` (and pynvml) number them.

Here so that code which must not load pynvml (the simulated GPU, the MIG tables) speaks
NVML's numbers; :mod:`.nvml` reads the same values from the pynvml module it is given.
"""

from __future__ import annotations

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

# nvmlEventData_t.gpuInstanceId / computeInstanceId when the event is not an instance's.
NVML_INSTANCE_ID_ANY = 0xFFFFFFFF

ERROR_NAMES = {
    NVML_SUCCESS: "Success",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_IN_USE: "In use by another client",
    NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient Resources",
}


def error_name(code: int) -> str:
    """NVML's own text for a return code (``nvmlErrorString``), or the number."""
    return ERROR_NAMES.get(code, f"NVML error {code}")
