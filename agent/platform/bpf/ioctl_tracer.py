"""NVIDIA ioctl attribution per (cgroup, process): bpf/ioctl_tracer.c in the kernel, map
reading here. bcc compiles it in a short-lived child (:mod:`.loaded`); this process attaches it
with perf events (:mod:`.perf`) and reads the maps with raw bpf(2) calls.

Attach points. By default the syscalls:sys_{enter,exit}_ioctl tracepoints, filtered in the
kernel to ``_IOWR('F', escape, size)`` commands (``(cmd & 0xC000FF00) == 0xC0004600``), which
keeps fbdev's plain 0x46xx ioctls out. Where the kernel has kprobes and the nvidia module is
loaded, :attr:`AttachMode.KPROBE` puts a kprobe/kretprobe pair on the driver's ioctl entry
instead (``nvidia_unlocked_ioctl`` from 545, ``nvidia_frontend_unlocked_ioctl`` up to 535),
so only calls that reached the driver are seen. UVM ioctls (/dev/nvidia-uvm) are plain small
integers that other drivers use too, and no cheap filter tells them apart at the syscall
tracepoint; they are not traced.

What is counted, per (cgroup v2 id, tgid, escape = cmd & 0xff): calls, errors (the syscall
returned < 0) and a log2 latency histogram from entry to exit of the same thread (one hash
lookup per call; the per-thread entry state lives in task-local storage, or an LRU hash on
kernels without it). Per (cgroup v2 id, tgid), from
RM_ALLOC / RM_FREE decoded in user memory: video-memory allocations (class
NV01_MEMORY_LOCAL_USER, size read from the allocation params at exit, after the driver rounded
it) and GPFIFO channel creations (GPU contexts), matched to their frees by (tgid, hRoot,
handle).

Allocations are accounted by the NVOS ``status`` the driver writes back (0 = success), not
by the syscall's return value, which is counted separately as an error. This keeps the
accounting testable on an ordinary fd (the ioctl returns -ENOTTY there while the crafted
struct says status 0). Its limit: with the tracepoints, a non-NVIDIA fd that receives an
'F' _IOWR ioctl carrying a plausible NVOS21/NVOS64 with status 0 is counted as an
allocation. No real driver uses that shape besides NVIDIA's, and the kprobe mode has no such
gap.

Other limits, documented rather than hidden: an object freed implicitly (its parent or its
client freed, or its fd closed) is subtracted only when its handle is reused or when the
process is forgotten (:meth:`IoctlTracer.forget`, called on process exit); objects shared
between processes (RM_DUP_OBJECT, RM_SHARE) are counted for the allocating process only;
params wrapped in IOCTL_XFER_CMD are counted as that escape, not decoded. Every map is
bounded (:class:`TracerLimits`); when one is full the lost events are counted in
:class:`DropCounts` instead of failing.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.errors import PlatformError
from agent.platform.bpf import perf
from agent.platform.bpf.ioctl_stats import (
    LATENCY_SLOTS,
    OBJECT_FIELDS,
    EscapeRow,
    IoctlSnapshot,
    ObjectRow,
    build_snapshot,
)
from agent.platform.bpf.loaded import LoadedObject, LoadError, load
from agent.platform.bpf.mapread import BatchReader

log = logging.getLogger(__name__)

DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "bpf" / "ioctl_tracer.c"
TRACEPOINT_ENTER = "syscalls:sys_enter_ioctl"
TRACEPOINT_EXIT = "syscalls:sys_exit_ioctl"
KPROBE_FUNCTIONS = ("nvidia_unlocked_ioctl", "nvidia_frontend_unlocked_ioctl")
ENTER_FN, EXIT_FN = "vcuda_ioctl_enter", "vcuda_ioctl_exit"
# struct formats of the maps' (key, value) in bpf/ioctl_tracer.c; a size mismatch fails start().
MAP_FORMATS = {
    # {cgroup_id, tgid, escape}: {calls, errors, latency[LATENCY_SLOTS]}
    b"escape_stats": ("=QII", f"={2 + LATENCY_SLOTS}Q"),
    # {cgroup_id, tgid, pad}: OBJECT_FIELDS
    b"proc_objects": ("=QII", f"={len(OBJECT_FIELDS)}Q"),
    # {tgid, h_root, h_object, pad}: {size, cgroup_id, kind, pad}
    b"objects": ("=IIII", "=QQII"),
}
DROPS_MAP = b"drops"  # u64 per drop kind, indexed by u32


class IoctlTracerError(PlatformError):
    """The ioctl tracer could not be compiled, loaded, attached or read."""


class AttachMode(enum.Enum):
    """Where the programs attach: the ioctl syscall tracepoints, or the driver's ioctl entry."""

    TRACEPOINT = "tracepoint"
    KPROBE = "kprobe"


@dataclass(frozen=True)
class TracerLimits:
    """Map sizes. Full maps drop events (counted in DropCounts) rather than fail calls."""

    escapes: int = 65536  # (cgroup, pid, escape) triples
    procs: int = 10240  # (cgroup, pid) pairs that allocated video memory or channels
    objects: int = 65536  # live video-memory allocations and channels
    inflight: int = 10240  # threads inside an NVIDIA ioctl at once (only without task storage)

    def defines(self) -> dict[str, int]:
        return {
            "VCUDA_MAX_ESCAPES": self.escapes,
            "VCUDA_MAX_PROCS": self.procs,
            "VCUDA_MAX_OBJECTS": self.objects,
            "VCUDA_MAX_INFLIGHT": self.inflight,
        }


def generate_source(
    template: str, mode: AttachMode, limits: TracerLimits, kprobe_function: str, *, task_storage: bool = True
) -> str:
    """The exact program text handed to bcc: the C template behind a block of #defines."""
    where = (
        f"kprobe/kretprobe on {kprobe_function}"
        if mode is AttachMode.KPROBE
        else f"tracepoints {TRACEPOINT_ENTER}, {TRACEPOINT_EXIT}"
    )
    defines = {
        "VCUDA_ATTACH_KPROBE": int(mode is AttachMode.KPROBE),
        "VCUDA_TASK_STORAGE": int(task_storage),
        **limits.defines(),
    }
    head = [f"// vcuda-agent ioctl tracer, attached to {where}"]
    head += [f"#define {name} {value}" for name, value in defines.items()]
    return "\n".join(head) + "\n" + template


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class IoctlTracer:
    """Loads the ioctl tracer, attaches it, and reads its maps. Not running until :meth:`start`."""

    def __init__(
        self,
        *,
        mode: AttachMode = AttachMode.TRACEPOINT,
        kprobe_function: str = KPROBE_FUNCTIONS[0],
        limits: TracerLimits | None = None,
        source_path: Path = DEFAULT_SOURCE,
        task_storage: bool | None = None,
    ) -> None:
        """``task_storage``: per-thread state in task-local storage (True), an LRU hash (False), or the
        first that loads (None)."""
        self.mode = mode
        self.kprobe_function = kprobe_function
        self.limits = limits or TracerLimits()
        self.source_path = source_path
        self._bpf: LoadedObject | None = None  # the loaded programs and maps (fds)
        self._attached = False
        self._points: list[tuple[str, int]] = []  # (event, perf event fd) attached now
        self._task_storage_choices = (True, False) if task_storage is None else (task_storage,)
        self.task_storage = self._task_storage_choices[0]
        self._readers: dict[bytes, BatchReader] = {}
        self._lock = threading.Lock()

    # -- program ------------------------------------------------------------------------------

    def source(self) -> str:
        """The generated program, exactly as it is compiled (for ``--dump-bpf``)."""
        try:
            template = self.source_path.read_text()
        except OSError as err:
            raise IoctlTracerError(
                f"cannot read the ioctl tracer source {self.source_path}: {err}; "
                "the agent's bpf/ directory must be installed next to the package"
            ) from err
        return generate_source(
            template, self.mode, self.limits, self.kprobe_function, task_storage=self.task_storage
        )

    @property
    def running(self) -> bool:
        return self._bpf is not None

    @property
    def attached(self) -> bool:
        return self._attached

    def start(self) -> None:
        """Compile, load and attach. Raises IoctlTracerError with the reason on any failure."""
        with self._lock:
            if self._bpf is not None:
                return
            failures = []
            for task_storage in self._task_storage_choices:  # task storage needs Linux >= 5.11 with BTF
                self.task_storage = task_storage
                try:
                    self._bpf = self._load()
                    break
                except IoctlTracerError as err:
                    failures.append(err)
                    if isinstance(err.__cause__, LoadError) and err.__cause__.stage in ("import", "child"):
                        raise  # no bcc, or no loader: the other variant fails the same way
            else:
                if len(failures) == 1:
                    raise failures[0]
                raise IoctlTracerError(f"{failures[0]}; without task storage: {failures[1]}") from failures[1]
            if failures:
                log.info("ioctl tracer: no task storage (%s); per-thread state in a hash map", failures[0])
        try:
            self.attach()
        except IoctlTracerError:
            self.stop()
            raise
        log.info("ioctl tracer attached (%s)", self.mode.value)

    def _load(self) -> LoadedObject:
        text = self.source()
        kind = "kprobe" if self.mode is AttachMode.KPROBE else "tracepoint"
        maps = [name.decode() for name in (*MAP_FORMATS, DROPS_MAP)]
        try:
            loaded = load(text, [(ENTER_FN, kind), (EXIT_FN, kind)], maps)
        except LoadError as err:
            if err.stage == "import":
                message = f"bcc is not importable ({err}): install Debian's python3-bpfcc"
            elif err.stage == "compile":
                message = (
                    f"compiling the ioctl tracer failed ({err}); bcc needs kernel headers "
                    f"under /lib/modules/<release>/build (see `vcuda-agent --dump-bpf` for the program)"
                )
            elif err.stage == "child":
                message = f"loading the ioctl tracer failed: {err}"
            else:  # the verifier or the kernel refused a program
                message = f"the kernel refused the ioctl tracer: {err}"
            raise IoctlTracerError(message) from err
        try:
            self._readers = {
                name: BatchReader(loaded[name.decode()], *formats) for name, formats in MAP_FORMATS.items()
            }
            self._readers[DROPS_MAP] = BatchReader(loaded[DROPS_MAP.decode()], "=I", "=Q", chunk=8)
        except ValueError as err:
            loaded.close()
            raise IoctlTracerError(f"the ioctl tracer's maps do not match this agent: {err}") from err
        return loaded

    def attach(self) -> None:
        """Attach the loaded program (idempotent); :meth:`detach` keeps the maps."""
        with self._lock:
            loaded = self._require_bpf()
            if self._attached:
                return
            for kind, event, fn_name in self._attach_points():
                prog_fd = loaded.program(fn_name).fd
                try:
                    if kind == "tracepoint":
                        category, name = event.split(":", 1)
                        fd = perf.attach_tracepoint(prog_fd, category, name)
                    else:
                        fd = perf.attach_kprobe(prog_fd, event, retprobe=kind == "kretprobe")
                except perf.PerfAttachError as err:
                    self._detach_points()
                    raise IoctlTracerError(
                        f"attaching the ioctl tracer to {event} failed ({_describe(err)}); it needs "
                        "root (CAP_BPF + CAP_PERFMON) and tracefs at /sys/kernel/tracing"
                    ) from err
                self._points.append((event, fd))
            self._attached = True

    def detach(self) -> None:
        """Detach the program and keep it loaded with its maps (attach() again resumes counting)."""
        with self._lock:
            self._detach_points()
            self._attached = False

    def stop(self) -> None:
        """Detach and unload; the maps go with the program. Idempotent."""
        with self._lock:
            loaded, self._bpf = self._bpf, None
            self._detach_points()
            self._readers.clear()
            self._attached = False
            if loaded is not None:
                loaded.close()

    def __enter__(self) -> IoctlTracer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _attach_points(self) -> list[tuple[str, str, str]]:
        """(kind, event, program): kind tracepoint, kprobe or kretprobe."""
        if self.mode is AttachMode.KPROBE:
            return [("kprobe", self.kprobe_function, ENTER_FN), ("kretprobe", self.kprobe_function, EXIT_FN)]
        return [("tracepoint", TRACEPOINT_ENTER, ENTER_FN), ("tracepoint", TRACEPOINT_EXIT, EXIT_FN)]

    def _detach_points(self) -> None:
        """Close the perf events: the kernel detaches the program from each."""
        while self._points:
            event, fd = self._points.pop()
            try:
                os.close(fd)
            except OSError as err:
                raise IoctlTracerError(f"detaching the ioctl tracer from {event} failed: {err}") from err

    def _require_bpf(self) -> LoadedObject:
        if self._bpf is None:
            raise IoctlTracerError("the ioctl tracer is not started")
        return self._bpf

    # -- maps ---------------------------------------------------------------------------------

    def snapshot(self) -> IoctlSnapshot:
        """Everything counted so far, per (cgroup id, pid). Reads the maps; clears nothing."""
        with self._lock:
            self._require_bpf()
            try:
                escapes = [
                    EscapeRow(cgroup, tgid, escape, v[0], v[1], v[2:])
                    for (cgroup, tgid, escape), v in self._reader(b"escape_stats").rows()
                ]
                objects = [ObjectRow(k[0], k[1], v) for k, v in self._reader(b"proc_objects").rows()]
                drops = [v[0] for _, v in sorted(self._reader(DROPS_MAP).rows())]
            except Exception as err:
                raise IoctlTracerError(f"reading the ioctl tracer's maps failed: {_describe(err)}") from err
        return build_snapshot(escapes, objects, drops)

    def forget(self, *pids: int) -> int:
        """Drop every entry of these processes (call it when they have exited); returns how many.

        One pass over the maps whatever the number of pids, so batch the exits of a period."""
        gone = set(pids)
        with self._lock:
            bpf = self._require_bpf()
            removed = 0
            try:
                for name, tgid_field in ((b"escape_stats", 1), (b"proc_objects", 1), (b"objects", 0)):
                    table, reader = bpf[name.decode()], self._reader(name)
                    for key, _ in reader.rows():
                        # False: the kernel side deleted it meanwhile (a free)
                        if key[tgid_field] in gone and table.delete(reader.key(key)):
                            removed += 1
            except Exception as err:
                raise IoctlTracerError(
                    f"forgetting pids {sorted(gone)} in the ioctl tracer: {_describe(err)}"
                ) from err
            return removed

    def object_count(self) -> int:
        """Live video-memory objects and channels remembered (for saturation metrics)."""
        with self._lock:
            self._require_bpf()
            return len(self._reader(b"objects").rows())

    def _reader(self, name: bytes) -> BatchReader:
        return self._readers[name]
