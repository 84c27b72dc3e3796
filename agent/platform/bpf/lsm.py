"""Memory mode `deny`: bpf/memquota_lsm.c on the file_ioctl LSM hook, compiled by bcc in a
short-lived child (:mod:`.loaded`) and attached here with BPF_RAW_TRACEPOINT_OPEN.

The program refuses video-memory RM_ALLOC ioctls that would take a container over its
quota (-ENOMEM to the caller, which CUDA reports as out of memory). It needs a kernel that
runs BPF LSM ("bpf" in /sys/kernel/security/lsm, normally via the ``lsm=`` boot parameter)
and kernel BTF; :func:`probe_bpf_lsm` says whether this node has them, and the caller falls
back to killing the process that went over (memory mode `kill`) when it does not, or when
:meth:`MemoryDenyProgram.start` fails anyway.

Not verified on hardware: the development machine refuses to load BPF LSM programs, so the
decision is unit-tested through its Python mirror ``agent.domain.memquota.lsm_allows``.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import PlatformError
from agent.platform.bpf import syscall
from agent.platform.bpf.loaded import LoadedObject, LoadError, find_bcc, load
from agent.platform.bpf.maps import BpfMap

log = logging.getLogger(__name__)

DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "bpf" / "memquota_lsm.c"
DEFAULT_SECURITY_DIR = Path("/sys/kernel/security")
DEFAULT_BTF = Path("/sys/kernel/btf/vmlinux")
LSM_FUNCTION = "lsm__file_ioctl"  # what LSM_PROBE(file_ioctl, ...) names the program
QUOTA_MAP = "quotas"
QUOTA_KEY, QUOTA_VALUE = struct.Struct("=Q"), struct.Struct("=QQ")  # cgroup id -> struct quota


class MemoryDenyError(PlatformError):
    """The BPF LSM program could not be compiled, loaded, attached or updated."""


@dataclass(frozen=True)
class LsmSupport:
    usable: bool
    reason: str  # why not; empty when usable


def probe_bpf_lsm(
    security_dir: Path = DEFAULT_SECURITY_DIR,
    btf: Path = DEFAULT_BTF,
    *,
    import_bcc: Callable[[], object] = find_bcc,
) -> LsmSupport:
    """Check, in order: the active LSMs list "bpf", kernel BTF exists, bcc imports."""
    lsm_file = security_dir / "lsm"
    try:
        active = [name.strip() for name in lsm_file.read_text().split(",") if name.strip()]
    except FileNotFoundError:
        return LsmSupport(
            False,
            f"{lsm_file} does not exist: securityfs is not mounted at {security_dir} "
            f"(mount -t securityfs securityfs {security_dir}) or the kernel has no LSM support",
        )
    except OSError as err:
        return LsmSupport(False, f"cannot read the active LSMs from {lsm_file}: {err}")
    if "bpf" not in active:
        return LsmSupport(
            False,
            f"BPF LSM is not active (active LSMs: {','.join(active) or 'none'}); it needs a kernel "
            "with CONFIG_BPF_LSM=y booted with bpf in lsm=...",
        )
    if not btf.exists():
        return LsmSupport(False, f"no kernel BTF at {btf} (CONFIG_DEBUG_INFO_BTF=y): LSM programs need it")
    try:
        import_bcc()
    except ImportError as err:
        return LsmSupport(False, f"bcc is not importable ({err}); install Debian's python3-bpfcc")
    return LsmSupport(True, "")


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class MemoryDenyProgram:
    """The loaded LSM program and its quota map. Nothing is loaded until :meth:`start`."""

    def __init__(self, source_path: Path = DEFAULT_SOURCE, max_quotas: int = 4096) -> None:
        self.source_path = source_path
        self.max_quotas = max_quotas
        self._bpf: LoadedObject | None = None
        self._link_fd = -1  # BPF_RAW_TRACEPOINT_OPEN's link: closing it detaches
        self._lock = threading.Lock()

    def source(self) -> str:
        """The program exactly as it is compiled."""
        try:
            template = self.source_path.read_text()
        except OSError as err:
            raise MemoryDenyError(f"cannot read the memory quota program {self.source_path}: {err}") from err
        return (
            f"// vcuda-agent memory quotas (BPF LSM file_ioctl)\n#define VCUDA_MAX_QUOTAS {self.max_quotas}\n"
            + template
        )

    @property
    def running(self) -> bool:
        return self._bpf is not None

    def start(self) -> None:
        """Compile, load and attach; raises MemoryDenyError with the reason. Idempotent."""
        refused = (
            "the kernel refused to load or attach the BPF LSM program for memory mode deny ({}; bcc "
            "reports every EPERM as missing privileges, and as root it means this kernel does not "
            "accept BPF LSM programs)"
        )
        with self._lock:
            if self._bpf is not None:
                return
            text = self.source()
            try:
                loaded = load(text, [(LSM_FUNCTION, "lsm")], [QUOTA_MAP])
            except LoadError as err:
                if err.stage == "import":
                    raise MemoryDenyError(
                        f"bcc is not importable ({err}): install Debian's python3-bpfcc"
                    ) from err
                if err.stage == "compile":
                    raise MemoryDenyError(
                        f"compiling the memory quota LSM program failed ({err}); bcc needs kernel "
                        "headers under /lib/modules/<release>/build"
                    ) from err
                raise MemoryDenyError(refused.format(err)) from err
            try:
                self._link_fd = syscall.raw_tracepoint_open(loaded.program(LSM_FUNCTION).fd)
            except syscall.BpfSyscallError as err:
                loaded.close()
                raise MemoryDenyError(refused.format(err)) from err
            table = loaded[QUOTA_MAP]
            if (table.key_size, table.value_size) != (QUOTA_KEY.size, QUOTA_VALUE.size):
                self._close(loaded)
                raise MemoryDenyError(
                    f"the quota map is {table.key_size}+{table.value_size} bytes, this agent expects "
                    f"{QUOTA_KEY.size}+{QUOTA_VALUE.size}: bpf/memquota_lsm.c and lsm.py disagree"
                )
            self._bpf = loaded
        log.info("memory quota LSM program attached to file_ioctl")

    def set_quota(self, cgroup_id: int, quota_bytes: int, used_bytes: int) -> None:
        """Refuse video-memory allocations of this cgroup beyond ``quota_bytes``, counting from
        ``used_bytes`` (the measured use; it replaces what the program reserved since)."""
        with self._lock:
            table = self._table()
            try:
                table.update(QUOTA_KEY.pack(cgroup_id), QUOTA_VALUE.pack(quota_bytes, used_bytes))
            except (syscall.BpfSyscallError, struct.error) as err:
                raise MemoryDenyError(
                    f"setting the memory quota of cgroup {cgroup_id}: {_describe(err)}"
                ) from err

    def remove_quota(self, cgroup_id: int) -> None:
        """The cgroup is no longer limited (the container went away)."""
        with self._lock:
            table = self._table()
            try:
                table.delete(QUOTA_KEY.pack(cgroup_id))  # False: never set, or already removed
            except syscall.BpfSyscallError as err:
                raise MemoryDenyError(
                    f"removing the memory quota of cgroup {cgroup_id}: {_describe(err)}"
                ) from err

    def quotas(self) -> dict[int, tuple[int, int]]:
        """cgroup id -> (quota bytes, used bytes) as the program sees them now."""
        with self._lock:
            table = self._table()
            try:
                rows = table.items()
            except syscall.BpfSyscallError as err:
                raise MemoryDenyError(f"reading the memory quota map: {_describe(err)}") from err
            out: dict[int, tuple[int, int]] = {}
            for key, value in rows:
                quota, used = QUOTA_VALUE.unpack(value)
                out[QUOTA_KEY.unpack(key)[0]] = (quota, used)
            return out

    def stop(self) -> None:
        """Detach and unload (the quotas go with it). Idempotent."""
        with self._lock:
            loaded, self._bpf = self._bpf, None
            if loaded is not None:
                self._close(loaded)

    def _close(self, loaded: LoadedObject) -> None:
        if self._link_fd >= 0:
            fd, self._link_fd = self._link_fd, -1
            os.close(fd)
        loaded.close()

    def _table(self) -> BpfMap:
        if self._bpf is None:
            raise MemoryDenyError("the memory quota LSM program is not started")
        return self._bpf[QUOTA_MAP]
