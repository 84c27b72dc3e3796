"""The NVIDIA RM ioctl ABI the tracer decodes: command numbers, escapes, classes, argument structs.

RM ioctls are ``_IOWR('F', escape, sizeof(params))`` on /dev/nvidiactl (and /dev/nvidiaN).
The structs mirror ``nvos.h`` of the open GPU kernel modules; tests and the benchmark use
them to craft NVIDIA-shaped ioctls on ordinary file descriptors.
"""

from __future__ import annotations

import ctypes

IOC_WRITE, IOC_READ = 1, 2
NV_IOCTL_MAGIC = ord("F")
# (cmd & mask) == match keeps _IOWR('F', ...) and drops fbdev's plain 0x46xx ioctls.
NV_IOCTL_MASK = 0xC000FF00
NV_IOCTL_MATCH = 0xC0004600

ESCAPES: dict[int, str] = {
    0x27: "RM_ALLOC_MEMORY",
    0x28: "RM_ALLOC_OBJECT",
    0x29: "RM_FREE",
    0x2A: "RM_CONTROL",
    0x2B: "RM_ALLOC",
    0x34: "RM_DUP_OBJECT",
    0x35: "RM_SHARE",
    0x4A: "RM_VID_HEAP_CONTROL",
    0x4E: "RM_MAP_MEMORY",
    0x4F: "RM_UNMAP_MEMORY",
    0xC8: "CARD_INFO",
    0xC9: "REGISTER_FD",
    0xCE: "ALLOC_OS_EVENT",
    0xCF: "FREE_OS_EVENT",
    0xD1: "STATUS_CODE",
    0xD2: "CHECK_VERSION_STR",
    0xD3: "IOCTL_XFER_CMD",
    0xD4: "ATTACH_GPUS_TO_FD",
}
ESC_RM_FREE, ESC_RM_CONTROL, ESC_RM_ALLOC = 0x29, 0x2A, 0x2B

NV01_MEMORY_LOCAL_USER = 0x40
NV01_MEMORY_SYSTEM = 0x3E
GPFIFO_CLASSES = frozenset({0xA06F, 0xA16F, 0xB06F, 0xC06F, 0xC36F, 0xC46F, 0xC56F, 0xC86F, 0xC96F, 0xCA6F})
MEMORY_ALLOCATION_SIZE_OFFSET = 64  # NV_MEMORY_ALLOCATION_PARAMS.size (u64)


def iowr(type_: int, nr: int, size: int) -> int:
    """Linux's _IOWR(type, nr, size) for x86_64 and arm64 (14-bit size field)."""
    if not 0 <= size < (1 << 14):
        raise ValueError(f"ioctl argument size {size} does not fit in 14 bits")
    return ((IOC_READ | IOC_WRITE) << 30) | (size << 16) | (type_ << 8) | nr


def is_nvidia_rm_cmd(cmd: int) -> bool:
    """True for the commands the tracer counts: ``_IOWR('F', escape, size)``."""
    return (cmd & NV_IOCTL_MASK) == NV_IOCTL_MATCH


def escape_of(cmd: int) -> int:
    return cmd & 0xFF


def escape_name(escape: int) -> str:
    return ESCAPES.get(escape, f"0x{escape:02x}")


class NVOS00(ctypes.Structure):
    """RM_FREE argument."""

    _fields_ = (
        ("hRoot", ctypes.c_uint32),
        ("hObjectParent", ctypes.c_uint32),
        ("hObjectOld", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
    )


class NVOS21(ctypes.Structure):
    """RM_ALLOC argument, 32 bytes."""

    _fields_ = (
        ("hRoot", ctypes.c_uint32),
        ("hObjectParent", ctypes.c_uint32),
        ("hObjectNew", ctypes.c_uint32),
        ("hClass", ctypes.c_uint32),
        ("pAllocParms", ctypes.c_uint64),
        ("paramsSize", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
    )


class NVOS64Pre535(ctypes.Structure):
    """RM_ALLOC argument with rights, before driver 535 (40 bytes, no FINN ``flags``)."""

    _fields_ = (
        ("hRoot", ctypes.c_uint32),
        ("hObjectParent", ctypes.c_uint32),
        ("hObjectNew", ctypes.c_uint32),
        ("hClass", ctypes.c_uint32),
        ("pAllocParms", ctypes.c_uint64),
        ("pRightsRequested", ctypes.c_uint64),
        ("paramsSize", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
    )


class NVOS64(ctypes.Structure):
    """RM_ALLOC argument with rights, driver 535 and later (48 bytes)."""

    _fields_ = (
        ("hRoot", ctypes.c_uint32),
        ("hObjectParent", ctypes.c_uint32),
        ("hObjectNew", ctypes.c_uint32),
        ("hClass", ctypes.c_uint32),
        ("pAllocParms", ctypes.c_uint64),
        ("pRightsRequested", ctypes.c_uint64),
        ("paramsSize", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
    )


class MemoryAllocationParams(ctypes.Structure):
    """The head of NV_MEMORY_ALLOCATION_PARAMS up to ``size`` (the real struct is longer)."""

    _fields_ = (
        ("owner", ctypes.c_uint32),
        ("type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("width", ctypes.c_uint32),
        ("height", ctypes.c_uint32),
        ("pitch", ctypes.c_int32),
        ("attr", ctypes.c_uint32),
        ("attr2", ctypes.c_uint32),
        ("format", ctypes.c_uint32),
        ("comprCovg", ctypes.c_uint32),
        ("zcullCovg", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("rangeLo", ctypes.c_uint64),
        ("rangeHi", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("alignment", ctypes.c_uint64),
    )


RM_FREE = iowr(NV_IOCTL_MAGIC, ESC_RM_FREE, ctypes.sizeof(NVOS00))
RM_CONTROL = iowr(NV_IOCTL_MAGIC, ESC_RM_CONTROL, 32)  # NVOS54
RM_ALLOC_21 = iowr(NV_IOCTL_MAGIC, ESC_RM_ALLOC, ctypes.sizeof(NVOS21))
RM_ALLOC_64_PRE535 = iowr(NV_IOCTL_MAGIC, ESC_RM_ALLOC, ctypes.sizeof(NVOS64Pre535))
RM_ALLOC_64 = iowr(NV_IOCTL_MAGIC, ESC_RM_ALLOC, ctypes.sizeof(NVOS64))
