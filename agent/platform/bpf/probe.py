"""Can this node run the ioctl tracer? Feature probes, checked in order, with the reason when not.

The agent says "running on NVML alone: <reason>" once when BPF is unusable and exports
:class:`BpfStatus` as a metric label, so the status values are stable. Every root (/proc,
/sys, /lib/modules) is injectable so tests run over fake trees.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.platform.bpf.ioctl_tracer import KPROBE_FUNCTIONS, AttachMode
from agent.platform.bpf.loaded import find_bcc

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39
TRACEFS_DIRS = ("kernel/tracing", "kernel/debug/tracing")  # under /sys
IOCTL_EVENTS = ("syscalls/sys_enter_ioctl", "syscalls/sys_exit_ioctl")
HOST_MOUNTS_HINT = "mount the host's /lib/modules and /usr/src read-only into the agent pod"


class BpfStatus(enum.Enum):
    """Why the tracer can (``ok``) or cannot run; the values are metric labels and stay stable."""

    OK = "ok"
    NO_BCC = "no-bcc"
    NOT_PERMITTED = "not-permitted"
    NO_HEADERS = "no-headers"
    NO_TRACEFS = "no-tracefs"
    LOAD_FAILED = "load-failed"


@dataclass(frozen=True)
class ProbeRoots:
    """The host trees the probes read (fake trees in tests)."""

    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    modules: Path = Path("/lib/modules")


@dataclass(frozen=True)
class BpfSupport:
    """The outcome of :func:`probe_bpf`; ``reason`` is empty when ``status`` is OK."""

    status: BpfStatus
    reason: str
    kernel_release: str
    headers: Path | None = None  # the directory bcc compiles against
    tracefs: Path | None = None
    kprobes: bool = False
    nvidia_module: bool = False
    kprobe_function: str | None = None  # the driver's ioctl entry, when kprobes and the module are there

    @property
    def usable(self) -> bool:
        return self.status is BpfStatus.OK

    @property
    def attach_mode(self) -> AttachMode:
        """Kprobe on the driver where possible (real driver calls only), else the syscall tracepoints."""
        return AttachMode.KPROBE if self.kprobe_function else AttachMode.TRACEPOINT

    def load_failed(self, error: BaseException) -> BpfSupport:
        """The probes passed but compiling, loading or attaching failed anyway."""
        return dataclasses.replace(self, status=BpfStatus.LOAD_FAILED, reason=str(error))


def _import_bcc() -> None:
    """bcc is there for the loader process (looked up, not imported: see agent.platform.bpf.loaded)."""
    find_bcc()


def _effective_caps(proc: Path) -> int | None:
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _has_bpf_caps(caps: int) -> bool:
    def has(cap: int) -> bool:
        return bool(caps & (1 << cap))

    return has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON))


def _headers(roots: ProbeRoots, release: str) -> Path | None:
    build = roots.modules / release / "build"
    if (build / "include").is_dir():
        return build
    kheaders = roots.sys / "kernel" / "kheaders.tar.xz"  # CONFIG_IKHEADERS: bcc unpacks it itself
    return kheaders if kheaders.is_file() else None


def _tracefs(roots: ProbeRoots) -> tuple[Path | None, Path | None]:
    """(tracefs with the ioctl events, any mounted tracefs)."""
    mounted = None
    for rel in TRACEFS_DIRS:
        path = roots.sys / rel
        if not (path / "events").is_dir():
            continue
        mounted = mounted or path
        if all((path / "events" / event).is_dir() for event in IOCTL_EVENTS):
            return path, path
    return None, mounted


def _nvidia_loaded(roots: ProbeRoots) -> bool:
    if (roots.sys / "module" / "nvidia").is_dir():
        return True
    try:
        text = (roots.proc / "modules").read_text()
    except OSError:
        return False
    return any(line.split(" ", 1)[0] == "nvidia" for line in text.splitlines())


def _driver_ioctl_symbol(proc: Path) -> str | None:
    try:
        with (proc / "kallsyms").open() as symbols:
            names = {line.split()[2] for line in symbols if "ioctl" in line and line.count(" ") >= 2}
    except OSError:
        return None
    return next((fn for fn in KPROBE_FUNCTIONS if fn in names), None)


def probe_bpf(
    roots: ProbeRoots | None = None,
    *,
    release: str | None = None,
    import_bcc: Callable[[], None] = _import_bcc,
) -> BpfSupport:
    """Check, in order: bcc, privileges, kernel headers, tracefs; then note kprobes and the nvidia module."""
    roots = roots or ProbeRoots()
    release = release or os.uname().release
    tracefs, mounted = _tracefs(roots)
    kprobes = mounted is not None and (mounted / "kprobe_events").exists()
    nvidia = _nvidia_loaded(roots)
    found = BpfSupport(
        BpfStatus.OK,
        "",
        release,
        headers=_headers(roots, release),
        tracefs=tracefs,
        kprobes=kprobes,
        nvidia_module=nvidia,
        kprobe_function=_driver_ioctl_symbol(roots.proc) if kprobes and nvidia else None,
    )

    def fail(status: BpfStatus, reason: str) -> BpfSupport:
        return dataclasses.replace(found, status=status, reason=reason)

    try:
        import_bcc()
    except ImportError as err:
        return fail(BpfStatus.NO_BCC, f"bcc is not importable ({err}); install Debian's python3-bpfcc")
    caps = _effective_caps(roots.proc)
    if caps is None or not _has_bpf_caps(caps):
        have = "unknown" if caps is None else f"CapEff {caps:#x}"
        return fail(
            BpfStatus.NOT_PERMITTED,
            f"loading BPF programs needs CAP_SYS_ADMIN or CAP_BPF + CAP_PERFMON ({have}); "
            "run the agent as root in a privileged pod",
        )
    if found.headers is None:
        build = roots.modules / release / "build"
        return fail(
            BpfStatus.NO_HEADERS,
            f"no kernel headers for {release} at {build} (bcc compiles against them): install the "
            f"host's linux-headers package and {HOST_MOUNTS_HINT}",
        )
    if tracefs is None:
        if mounted is None:
            reason = (
                f"tracefs is not mounted at {roots.sys / TRACEFS_DIRS[0]}: mount -t tracefs tracefs "
                f"{roots.sys / TRACEFS_DIRS[0]} (or mount the host's /sys/kernel/tracing into the pod)"
            )
        else:
            reason = (
                f"{mounted}/events has no syscalls:sys_enter_ioctl tracepoint "
                "(kernel built without CONFIG_FTRACE_SYSCALLS)"
            )
        return fail(BpfStatus.NO_TRACEFS, reason)
    return found
