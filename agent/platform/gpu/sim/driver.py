"""A simulated workload's NVIDIA driver calls, for the ioctl tracer.

A real CUDA process allocates video memory with RM_ALLOC and talks to the driver with
RM_CONTROL. A simulated one can issue the same ioctls, with the driver's argument layout
(``platform/bpf/nvioctl.py``), on /dev/null: the kernel refuses them (ENOTTY), but the
``sys_enter_ioctl``/``sys_exit_ioctl`` tracepoints see exactly what they would on
``/dev/nvidiactl``, so the tracer attributes calls and video memory to the container as on
a GPU node. The NVOS ``status`` field stays 0 (success), which is what the tracer counts by.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets

from agent.errors import SimulationError
from agent.platform.bpf import nvioctl as nv

MIB = 1 << 20


class SimDriverCalls:
    """One process's driver client: a root handle and the objects it allocated."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        try:
            self._fd = os.open("/dev/null", os.O_RDWR)
        except OSError as err:
            raise SimulationError(f"cannot open /dev/null for simulated driver calls: {err}") from err
        self._root = 0xC1D00000 | secrets.randbits(16)
        self._next_handle = 0x5C000001
        self._control = (ctypes.c_char * ctypes.sizeof(nv.NVOS21))()
        self.calls = 0

    def allocate(self, mib: int) -> None:
        """RM_ALLOC of ``mib`` MiB of video memory (NV01_MEMORY_LOCAL_USER)."""
        if mib <= 0:
            return
        params = nv.MemoryAllocationParams(size=mib * MIB)
        arg = nv.NVOS21(
            hRoot=self._root,
            hObjectParent=self._root,
            hObjectNew=self._next_handle,
            hClass=nv.NV01_MEMORY_LOCAL_USER,
            pAllocParms=ctypes.addressof(params),
            paramsSize=ctypes.sizeof(params),
            status=0,
        )
        self._next_handle += 1
        self._ioctl(nv.RM_ALLOC_21, ctypes.addressof(arg))

    def control(self) -> None:
        """One RM_CONTROL, as a CUDA process issues many (queries, launches' bookkeeping)."""
        self._ioctl(nv.RM_CONTROL, ctypes.addressof(self._control))

    def _ioctl(self, cmd: int, arg: int) -> None:
        rc = self._libc.ioctl(self._fd, cmd, arg)
        if rc != -1 or ctypes.get_errno() != errno.ENOTTY:  # /dev/null must refuse it
            raise SimulationError(f"unexpected answer from /dev/null to ioctl {cmd:#x}: rc={rc}")
        self.calls += 1

    def close(self) -> None:
        os.close(self._fd)
