"""BPF programs compiled and loaded by a child process, held in the agent by their fds.

:func:`load` starts ``python -m agent.platform.bpf.loader`` (see there for why), sends it the
program text with the programs and maps wanted, and gets back their fds and layouts. The agent
then attaches with raw syscalls (:mod:`.perf`, :mod:`.syscall`) and reads and writes the maps
with :class:`~agent.platform.bpf.maps.BpfMap`; bcc and LLVM never enter this process.
Closing a :class:`LoadedObject` closes every fd; the kernel frees a program when nothing else
(an attachment to a cgroup, a perf event) holds it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agent.errors import PlatformError
from agent.platform.bpf import syscall
from agent.platform.bpf.loader import MAX_FDS, PROGRAM_KINDS, recv_message, send_message
from agent.platform.bpf.maps import BpfMap

LOADER_MODULE = "agent.platform.bpf.loader"
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding agent/
DEFAULT_TIMEOUT_S = 120.0  # clang on a busy 2-core node takes seconds; a hang must end
DIAGNOSTICS_CHARS = 4000


class LoadError(PlatformError):
    """The loader process failed. ``stage``: import (no bcc), compile, load (the verifier or the
    kernel refused a program), map, or child (it crashed, hung or answered nonsense).
    ``error`` is bcc's exception text, ``diagnostics`` the tail of what the child printed."""

    def __init__(self, stage: str, error: str, diagnostics: str = "", name: str = "") -> None:
        self.stage = stage
        self.error = error
        self.diagnostics = diagnostics
        self.name = name
        super().__init__(f"{error}{'; ' + self.detail if self.detail else ''}")

    @property
    def detail(self) -> str:
        """The most telling line of the diagnostics: clang's first error, else the last line."""
        lines = [line.strip() for line in self.diagnostics.splitlines() if line.strip()]
        for line in lines:
            if "error:" in line:
                return line
        return lines[-1] if lines else ""


def find_bcc() -> None:
    """Raise ImportError unless the loader process will find BCC's Python module.

    Checked without importing it here: that would map libbcc and LLVM into this process."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or spec.origin is None:
        raise ImportError("No module named 'bcc'")
    try:
        text = Path(spec.origin).read_text(errors="replace")
    except OSError as err:
        raise ImportError(f"cannot read the 'bcc' module at {spec.origin}: {err}") from err
    if "class BPF" not in text:
        raise ImportError(f"the 'bcc' module at {spec.origin} is not BCC (the PyPI 'bcc' is unrelated)")


@dataclass
class Program:
    name: str
    kind: str
    fd: int
    id: int


class LoadedObject:
    """The programs and maps one loader run handed over, owned by this process."""

    def __init__(self, programs: dict[str, Program], maps: dict[str, BpfMap]) -> None:
        self.programs = programs
        self.maps = maps

    def program(self, name: str) -> Program:
        return self.programs[name]

    def __getitem__(self, name: str) -> BpfMap:
        return self.maps[name]

    def close(self) -> None:
        """Close every fd (idempotent)."""
        for prog in self.programs.values():
            if prog.fd >= 0:
                fd, prog.fd = prog.fd, -1
                os.close(fd)
        for table in self.maps.values():
            table.close()


def load(
    text: str,
    programs: list[tuple[str, str]],
    maps: list[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str = sys.executable,
) -> LoadedObject:
    """Compile ``text`` and load ``programs`` ((name, kind) pairs) in a child; raises LoadError."""
    for name, kind in programs:
        if kind not in PROGRAM_KINDS:
            raise ValueError(f"program {name}: kind {kind!r} is not one of {PROGRAM_KINDS}")
    if len(programs) + len(maps) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} programs and maps per load")
    try:
        return _run(text, programs, maps, timeout_s, python)
    except OSError as err:  # no socket, no temporary file: the loader could not even start
        raise LoadError("child", f"cannot run the BPF loader process: {err}") from err


def _run(
    text: str, programs: list[tuple[str, str]], maps: list[str], timeout_s: float, python: str
) -> LoadedObject:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # A file, not a pipe: a long verifier log must not block the child while we wait on the socket.
    with ours, tempfile.TemporaryFile() as errors:
        try:
            child = _spawn(python, theirs.fileno(), errors)
        finally:
            theirs.close()
        try:
            ours.settimeout(timeout_s)
            answer, fds = _exchange(ours, {"text": text, "programs": programs, "maps": maps})
        except (OSError, EOFError, ValueError) as err:
            if child.poll() is None:
                child.kill()  # hung, or answering nonsense: it has nothing more to give
            _reap(child)
            what = "timed out" if isinstance(err, TimeoutError) else f"failed ({err})"
            raise LoadError(
                "child", f"the BPF loader process {what}, exit status {child.returncode}", _tail(errors)
            ) from err
        _reap(child)
        if not answer.get("ok"):
            for fd in fds:  # none are sent with a failure; never leak what came anyway
                os.close(fd)
            raise LoadError(
                str(answer.get("stage", "child")),
                str(answer.get("error", "")),
                _tail(errors),
                str(answer.get("name", "")),
            )
    return _adopt(answer, fds, programs, maps)


def _spawn(python: str, fd: int, errors: IO[bytes]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.Popen(
            [python, "-m", LOADER_MODULE, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env=env,
        )
    except OSError as err:
        raise LoadError("child", f"cannot start the BPF loader process {python}: {err}") from err


def _exchange(sock: socket.socket, request: dict[str, object]) -> tuple[dict[str, object], list[int]]:
    send_message(sock, request)
    return recv_message(sock, MAX_FDS)


def _reap(child: subprocess.Popen[bytes]) -> None:
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _tail(errors: IO[bytes]) -> str:
    errors.seek(0)
    return errors.read().decode(errors="replace")[-DIAGNOSTICS_CHARS:]


def _adopt(
    answer: dict[str, object], fds: list[int], programs: list[tuple[str, str]], maps: list[str]
) -> LoadedObject:
    """Pair the fds with what was asked for; close them all if anything does not add up."""
    got_programs = answer.get("programs")
    got_maps = answer.get("maps")
    try:
        if not isinstance(got_programs, list) or not isinstance(got_maps, list):
            raise LoadError("child", f"the BPF loader answered without programs or maps: {answer}")
        if (
            len(fds) != len(programs) + len(maps)
            or len(got_programs) != len(programs)
            or len(got_maps) != len(maps)
        ):
            raise LoadError(
                "child",
                f"the BPF loader sent {len(fds)} fds for {len(programs)} programs and {len(maps)} maps",
            )
        loaded: dict[str, Program] = {}
        for (name, kind), fd in zip(programs, fds, strict=False):
            loaded[name] = Program(name, kind, fd, syscall.prog_info(fd).id)
        tables: dict[str, BpfMap] = {}
        for meta, fd in zip(got_maps, fds[len(programs) :], strict=True):
            tables[meta["name"]] = BpfMap(
                fd,
                meta["name"],
                map_type=int(meta["type"]),
                key_size=int(meta["key_size"]),
                value_size=int(meta["value_size"]),
                max_entries=int(meta["max_entries"]),
            )
    except (LoadError, syscall.BpfSyscallError, KeyError, TypeError) as err:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if isinstance(err, LoadError):
            raise
        raise LoadError("child", f"the BPF loader's answer is unusable: {err}") from err
    return LoadedObject(loaded, tables)
