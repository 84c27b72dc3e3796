"""GPU device rules on cgroup v2: bpf/device_guard.c, one program for every container.

The program is compiled once (bcc, ~0.5 s of clang, in a short-lived child process so that
LLVM never maps into the agent: :mod:`agent.platform.bpf.loaded`) and attached with BPF_F_ALLOW_MULTI
to each guarded container's scope directory; each container's policy is an entry in
the program's ``policies`` map, keyed by the directory's cgroup id. runc and crun
detach every program on a cgroup that has more than one when they update a container,
so ``ensure`` lists the attached programs (BPF_PROG_QUERY) and attaches again when ours
is gone. Programs of the same name left by an earlier agent process are detached once
ours is in place (no moment without a rule).

Stopping the agent leaves the programs attached and enforcing (the kernel keeps them and
their maps alive); the next agent process replaces them.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.platform.bpf import syscall
from agent.platform.bpf.loaded import LoadedObject, LoadError, load
from agent.platform.cgroups.devicepolicy import (
    NVIDIA_MAJOR,
    DevicePolicy,
    GuardError,
    NvidiaMajors,
    Outcome,
)
from agent.platform.cgroups.layout import UNIFIED

DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "bpf" / "device_guard.c"
PROG_NAME = "vcuda_devguard"  # the C function; also the kernel's name for the program
# Flags and major classes, as #defined in bpf/device_guard.c.
POLICY_HAS_GPU, POLICY_AUDIT = 1, 2
MAJOR_UVM, MAJOR_CAPS, MAJOR_OTHER, MAJOR_MIG_CAPS = 1, 2, 3, 4
MAX_CAPS = 16  # nvidia-caps minors one policy allows: two per MIG device (VCUDA_MAX_CAPS)
# The maps' layouts in bpf/device_guard.c: policies u64 -> struct policy, majors u32 -> u32.
# struct policy: gpu_minors[4], flags, ncaps, caps[VCUDA_MAX_CAPS], denied.
POLICY_KEY, POLICY_VALUE = struct.Struct("=Q"), struct.Struct(f"=4QII{MAX_CAPS}IQ")
MAJOR_KEY, MAJOR_VALUE = struct.Struct("=I"), struct.Struct("=I")


@dataclass(frozen=True)
class ProgramLimits:
    policies: int = 4096  # guarded containers at once
    depth: int = 16  # cgroup levels the program looks up from the task's cgroup


def generate_source(template: str, limits: ProgramLimits) -> str:
    """The exact program text handed to bcc: the C template behind a block of #defines."""
    head = [
        "// vcuda-agent device guard (BPF_PROG_TYPE_CGROUP_DEVICE)",
        f"#define VCUDA_MAX_POLICIES {limits.policies}",
        f"#define VCUDA_MAX_DEPTH {limits.depth}",
        f"#define VCUDA_MAX_CAPS {MAX_CAPS}",
    ]
    return "\n".join(head) + "\n" + template


def dump_source(source_path: Path = DEFAULT_SOURCE, limits: ProgramLimits | None = None) -> str:
    """The device program exactly as it is compiled (for ``vcuda-agent --dump-bpf``)."""
    try:
        template = source_path.read_text()
    except OSError as err:
        raise GuardError(
            f"cannot read the device guard source {source_path}: {err}; "
            "the agent's bpf/ directory must be installed next to the package"
        ) from err
    return generate_source(template, limits or ProgramLimits())


def policy_value(policy: DevicePolicy, audit: bool) -> bytes:
    """A ``policies`` map value: the GPU minor bitmap, the flags, the nvidia-caps minors."""
    if len(policy.cap_minors) > MAX_CAPS:
        raise GuardError(
            f"{len(policy.cap_minors)} nvidia-caps minors for one container; the device guard holds "
            f"{MAX_CAPS} (two per MIG device)"
        )
    flags = (POLICY_HAS_GPU if policy.has_gpu else 0) | (POLICY_AUDIT if audit else 0)
    caps = sorted(policy.cap_minors)
    padded = caps + [0] * (MAX_CAPS - len(caps))
    return POLICY_VALUE.pack(*gpu_minor_words(policy.gpu_minors or frozenset()), flags, len(caps), *padded, 0)


def gpu_minor_words(minors: frozenset[int]) -> list[int]:
    """The 256-bit GPU minor bitmap as four u64 words (bit N of the whole = minor N)."""
    words = [0, 0, 0, 0]
    for minor in minors:
        words[minor >> 6] |= 1 << (minor & 63)
    return words


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


@dataclass
class _Attached:
    cgroup_id: int
    policy: DevicePolicy
    audit: bool


class BpfDeviceRules:
    """``DeviceRules`` through the cgroup v2 device program. Compiles on first use."""

    controller = UNIFIED

    def __init__(
        self,
        majors: NvidiaMajors | None = None,
        source_path: Path = DEFAULT_SOURCE,
        limits: ProgramLimits | None = None,
    ) -> None:
        self._majors = majors or NvidiaMajors()
        self.source_path = source_path
        self.limits = limits or ProgramLimits()
        self._bpf: LoadedObject | None = None
        self._prog_fd = -1
        self.prog_id = 0
        self._attached: dict[Path, _Attached] = {}
        self._names: dict[int, str] = {}  # program id → name (ids are not reused soon)
        self._lock = threading.Lock()

    def source(self) -> str:
        """The generated program, exactly as this instance compiles it."""
        return dump_source(self.source_path, self.limits)

    def load(self) -> None:
        """Compile and load the program (idempotent). Raises GuardError with the reason."""
        with self._lock:
            self._load()

    def _load(self) -> LoadedObject:
        if self._bpf is not None:
            return self._bpf
        text = self.source()
        try:
            loaded = load(text, [(PROG_NAME, "cgroup_device")], ["policies", "majors"])
        except LoadError as err:
            if err.stage == "import":
                raise GuardError(f"bcc is not importable ({err}): install Debian's python3-bpfcc") from err
            raise GuardError(
                f"compiling or loading the device guard failed ({err}); bcc needs kernel "
                "headers under /lib/modules/<release>/build and root (see `vcuda-agent --dump-bpf`)"
            ) from err
        for name, key, value in (("policies", POLICY_KEY, POLICY_VALUE), ("majors", MAJOR_KEY, MAJOR_VALUE)):
            table = loaded[name]
            if (table.key_size, table.value_size) != (key.size, value.size):
                loaded.close()
                raise GuardError(
                    f"the device guard's map {name} is {table.key_size}+{table.value_size} bytes, this agent "
                    f"expects {key.size}+{value.size}: bpf/device_guard.c and devices_v2.py disagree"
                )
        program = loaded.program(PROG_NAME)
        self._bpf, self._prog_fd, self.prog_id = loaded, program.fd, program.id
        self._names[self.prog_id] = PROG_NAME
        self._write_majors()
        return loaded

    def set_majors(self, majors: NvidiaMajors) -> None:
        with self._lock:
            if majors != self._majors:
                self._majors = majors
                if self._bpf is not None:
                    self._write_majors()

    def _loaded(self) -> LoadedObject:
        if self._bpf is None:
            raise GuardError("the device guard is not loaded")
        return self._bpf

    def _write_majors(self) -> None:
        table = self._loaded()["majors"]
        wanted = {m: MAJOR_UVM for m in self._majors.uvm}
        wanted.update({m: MAJOR_OTHER for m in self._majors.other})
        wanted.update({m: MAJOR_CAPS for m in self._majors.caps})
        wanted.update({m: MAJOR_MIG_CAPS for m in self._majors.mig_caps})
        try:
            # Add before removing, so a driver reload never opens a moment without the rule.
            for major, cls in wanted.items():
                table.update(MAJOR_KEY.pack(major), MAJOR_VALUE.pack(cls))
            for key in [MAJOR_KEY.unpack(k)[0] for k in table]:
                if key not in wanted:
                    table.delete(MAJOR_KEY.pack(key))
        except syscall.BpfSyscallError as err:
            raise GuardError(
                f"cannot update the NVIDIA majors of the device guard ({_describe(err)})"
            ) from err

    def _write_policy(self, cgroup_id: int, policy: DevicePolicy, audit: bool) -> None:
        table = self._loaded()["policies"]
        value = policy_value(policy, audit)  # denied counted from 0
        try:
            table.update(POLICY_KEY.pack(cgroup_id), value)
        except syscall.BpfSyscallError as err:
            raise GuardError(
                f"cannot store the device policy of cgroup id {cgroup_id} ({_describe(err)}); "
                f"the map holds {self.limits.policies} entries at most"
            ) from err

    def _delete_policy(self, cgroup_id: int) -> None:
        self._loaded()["policies"].delete(POLICY_KEY.pack(cgroup_id))  # False: never stored, or gone

    def _name_of(self, prog_id: int) -> str:
        if prog_id not in self._names:
            try:
                self._names[prog_id] = syscall.prog_info_by_id(prog_id).name
            except syscall.BpfSyscallError:
                return ""  # detached and unloaded since the query
        return self._names[prog_id]

    @staticmethod
    def _open(cgroup_dir: Path) -> int:
        try:
            return os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise GuardError(f"cannot open cgroup {cgroup_dir}: {err.strerror or err}") from err

    def planned(self, cgroup_dir: Path, policy: DevicePolicy) -> list[str]:
        return [f"attach {PROG_NAME} to {cgroup_dir}: {policy.describe()} (char major {NVIDIA_MAJOR} ...)"]

    def ensure(self, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        with self._lock:
            self._load()
            fd = self._open(cgroup_dir)
            try:
                return self._ensure(fd, cgroup_dir, policy, audit)
            except syscall.BpfSyscallError as err:
                raise GuardError(f"cgroup {cgroup_dir}: {err}") from err
            finally:
                os.close(fd)

    def _ensure(self, fd: int, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        cgroup_id = os.fstat(fd).st_ino
        state = self._attached.get(cgroup_dir)
        if state is not None and state.cgroup_id != cgroup_id:
            self._delete_policy(state.cgroup_id)  # the directory was re-created: a new cgroup
            state = None
        if state is None or (state.policy, state.audit) != (policy, audit):
            self._write_policy(cgroup_id, policy, audit)
        self._attached[cgroup_dir] = _Attached(cgroup_id, policy, audit)
        ids = syscall.prog_query(fd, syscall.BPF_CGROUP_DEVICE)
        outcome = Outcome.APPLIED if state is None else Outcome.UNCHANGED
        if self.prog_id not in ids:
            syscall.prog_attach(self._prog_fd, fd, syscall.BPF_CGROUP_DEVICE, syscall.BPF_F_ALLOW_MULTI)
            outcome = Outcome.APPLIED if state is None else Outcome.REPAIRED
        for prog_id in ids:
            if prog_id != self.prog_id and self._name_of(prog_id) == PROG_NAME:
                try:
                    syscall.detach_by_id(fd, syscall.BPF_CGROUP_DEVICE, prog_id)
                except syscall.BpfSyscallError as err:
                    if err.errno != errno.ENOENT:  # someone else detached it first
                        raise
        return outcome

    def attached_to(self, cgroup_dir: Path) -> bool:
        """Whether this program is attached to the cgroup right now."""
        with self._lock:
            if self._bpf is None:
                return False
            fd = self._open(cgroup_dir)
            try:
                return self.prog_id in syscall.prog_query(fd, syscall.BPF_CGROUP_DEVICE)
            except syscall.BpfSyscallError as err:
                raise GuardError(f"cgroup {cgroup_dir}: {err}") from err
            finally:
                os.close(fd)

    def remove(self, cgroup_dir: Path) -> None:
        with self._lock:
            state = self._attached.pop(cgroup_dir, None)
            if state is None or self._bpf is None:
                return
            try:
                fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1  # the cgroup went with its pod, and the attachment with it
            except OSError as err:
                raise GuardError(f"cannot open cgroup {cgroup_dir}: {err.strerror or err}") from err
            try:
                if fd >= 0 and os.fstat(fd).st_ino == state.cgroup_id:
                    syscall.prog_detach(self._prog_fd, fd, syscall.BPF_CGROUP_DEVICE)
            except syscall.BpfSyscallError as err:
                if err.errno != errno.ENOENT:  # not attached: a runtime update detached it
                    raise GuardError(f"detaching the device guard from {cgroup_dir}: {err}") from err
            finally:
                if fd >= 0:
                    os.close(fd)
                self._delete_policy(state.cgroup_id)

    def denied(self, cgroup_dir: Path) -> int | None:
        with self._lock:
            state = self._attached.get(cgroup_dir)
            if state is None or self._bpf is None:
                return None
            value = self._bpf["policies"].lookup(POLICY_KEY.pack(state.cgroup_id))
            return None if value is None else int(POLICY_VALUE.unpack(value)[-1])

    def close(self) -> None:
        """Unload from this process; attached programs keep enforcing (see the module docstring)."""
        with self._lock:
            loaded, self._bpf = self._bpf, None
            self._attached.clear()
            self._prog_fd = -1
            if loaded is not None:
                loaded.close()  # attachments hold the program (and its maps) in the kernel
