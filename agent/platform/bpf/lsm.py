"""Memory mode `deny`: bpf/memquota_lsm.c on the file_ioctl LSM hook, loaded with bcc.

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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import PlatformError

log = logging.getLogger(__name__)

DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "bpf" / "memquota_lsm.c"
DEFAULT_SECURITY_DIR = Path("/sys/kernel/security")
DEFAULT_BTF = Path("/sys/kernel/btf/vmlinux")
LSM_FUNCTION = b"lsm__file_ioctl"  # what LSM_PROBE(file_ioctl, ...) names the program
QUOTA_MAP = b"quotas"


class MemoryDenyError(PlatformError):
    """The BPF LSM program could not be compiled, loaded, attached or updated."""


@dataclass(frozen=True)
class LsmSupport:
    usable: bool
    reason: str  # why not; empty when usable


def _bcc_module() -> Any:
    import bcc  # noqa: PLC0415  (optional: Debian's python3-bpfcc)

    if not hasattr(bcc, "BPF"):
        raise ImportError(f"the 'bcc' module at {bcc.__file__} is not BCC (the PyPI 'bcc' is unrelated)")
    return bcc


def probe_bpf_lsm(
    security_dir: Path = DEFAULT_SECURITY_DIR,
    btf: Path = DEFAULT_BTF,
    *,
    import_bcc: Callable[[], object] = _bcc_module,
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
        self._bpf: Any = None
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
        with self._lock:
            if self._bpf is not None:
                return
            try:
                bcc = _bcc_module()
            except ImportError as err:
                raise MemoryDenyError(
                    f"bcc is not importable ({err}): install Debian's python3-bpfcc"
                ) from err

            class _ExplicitAttach(bcc.BPF):  # type: ignore[misc,name-defined]
                # bcc loads and attaches lsm__* functions inside its constructor, and a refusal
                # there leaves the maps it created open; attaching ourselves lets us clean up.
                def _trace_autoload(self) -> None:
                    pass

            text = self.source()
            try:
                bpf = _ExplicitAttach(text=text.encode())
            except Exception as err:
                raise MemoryDenyError(
                    f"compiling the memory quota LSM program failed ({_describe(err)}); bcc needs kernel "
                    "headers under /lib/modules/<release>/build"
                ) from err
            try:
                bpf.attach_lsm(fn_name=LSM_FUNCTION)
            except Exception as err:
                bpf.cleanup()
                raise MemoryDenyError(
                    f"the kernel refused to load or attach the BPF LSM program for memory mode deny "
                    f"({_describe(err)}; bcc reports every EPERM as missing privileges, and as root "
                    "it means this kernel does not accept BPF LSM programs)"
                ) from err
            self._bpf = bpf
        log.info("memory quota LSM program attached to file_ioctl")

    def set_quota(self, cgroup_id: int, quota_bytes: int, used_bytes: int) -> None:
        """Refuse video-memory allocations of this cgroup beyond ``quota_bytes``, counting from
        ``used_bytes`` (the measured use; it replaces what the program reserved since)."""
        with self._lock:
            table = self._table()
            try:
                table[table.Key(cgroup_id)] = table.Leaf(quota_bytes, used_bytes)  # struct quota
            except Exception as err:
                raise MemoryDenyError(
                    f"setting the memory quota of cgroup {cgroup_id}: {_describe(err)}"
                ) from err

    def remove_quota(self, cgroup_id: int) -> None:
        """The cgroup is no longer limited (the container went away)."""
        with self._lock:
            table = self._table()
            try:
                del table[table.Key(cgroup_id)]
            except KeyError:
                pass  # was never set, or already removed
            except Exception as err:
                raise MemoryDenyError(
                    f"removing the memory quota of cgroup {cgroup_id}: {_describe(err)}"
                ) from err

    def quotas(self) -> dict[int, tuple[int, int]]:
        """cgroup id -> (quota bytes, used bytes) as the program sees them now."""
        with self._lock:
            table = self._table()
            try:
                return {int(k.value): (int(v.quota_bytes), int(v.used_bytes)) for k, v in table.items()}
            except Exception as err:
                raise MemoryDenyError(f"reading the memory quota map: {_describe(err)}") from err

    def stop(self) -> None:
        """Detach and unload (the quotas go with it). Idempotent."""
        with self._lock:
            bpf, self._bpf = self._bpf, None
        if bpf is not None:
            bpf.cleanup()

    def _table(self) -> Any:
        if self._bpf is None:
            raise MemoryDenyError("the memory quota LSM program is not started")
        return self._bpf[QUOTA_MAP]
