"""The kernel's name of the calling thread (``/proc/<pid>/task/<tid>/comm``), so that
``top -H``, ``ps -L`` and a per-thread CPU reading tell the agent's loops apart.

Linux keeps 15 bytes of it (``prctl(PR_SET_NAME)``); elsewhere, or where libc cannot be
loaded, naming is skipped: a thread's name is a diagnostic, never a reason to fail."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

PR_SET_NAME = 15
NAME_BYTES = 15


def set_native_name(name: str) -> bool:
    """Name the calling thread ``name`` (cut to 15 bytes); whether the kernel took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError as err:
        log.debug("thread names: libc not loaded (%s)", err)
        return False
    raw = name.encode("utf-8", "replace")[:NAME_BYTES]
    if libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        log.debug("thread names: prctl failed (errno %d)", ctypes.get_errno())
        return False
    return True
