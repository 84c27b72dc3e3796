"""The simulated node's shared state directory.

The simulated backend (inside the agent), workload processes and the event
injector are separate processes; they meet in one directory:

    <dir>/node.json          the simulated GPUs and the CPU core backing each
    <dir>/procs/<pid>.json   a workload: its GPU and the memory it declares
    <dir>/events/<name>.json an injected health event, consumed once

Every write is atomic (temp file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.errors import SimulationError
from agent.platform.gpu.inventory import DeviceEvent, EventKind

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/run/vcuda-agent/sim")


@dataclass(frozen=True)
class SimGpuSlot:
    index: int
    uuid: str
    core: int


@dataclass(frozen=True)
class SimNode:
    node_name: str
    agent_pid: int
    gpus: tuple[SimGpuSlot, ...]

    def core_of(self, gpu_index: int) -> int:
        for slot in self.gpus:
            if slot.index == gpu_index:
                return slot.core
        raise SimulationError(f"the simulated node has no GPU {gpu_index} (GPUs 0..{len(self.gpus) - 1})")


@dataclass(frozen=True)
class SimProcess:
    pid: int
    start_ticks: int
    gpu: int
    memory_mib: int


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise SimulationError(f"cannot write {path}: {err}") from err


class SimStateDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node_file = root / "node.json"
        self.procs_dir = root / "procs"
        self.events_dir = root / "events"
        # Parsed workload files by path, keyed by (inode, mtime, size): files are replaced, not edited.
        self._parsed: dict[Path, tuple[tuple[int, int, int], SimProcess]] = {}

    def create(self) -> None:
        try:
            for d in (self.root, self.procs_dir, self.events_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SimulationError(f"cannot create simulator state dir {self.root}: {err}") from err

    # node.json -------------------------------------------------------------
    def write_node(self, node: SimNode) -> None:
        _write_atomic(self.node_file, asdict(node))

    def read_node(self) -> SimNode:
        try:
            raw = json.loads(self.node_file.read_text())
            return SimNode(
                node_name=str(raw["node_name"]),
                agent_pid=int(raw["agent_pid"]),
                gpus=tuple(SimGpuSlot(int(g["index"]), str(g["uuid"]), int(g["core"])) for g in raw["gpus"]),
            )
        except FileNotFoundError as err:
            raise SimulationError(
                f"no simulated GPU node at {self.root}: start `vcuda-agent run --simulate SPEC` "
                "first, or pass the same --sim-state-dir"
            ) from err
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SimulationError(f"{self.node_file} is unreadable: {err}") from err

    def remove_node(self) -> None:
        self.node_file.unlink(missing_ok=True)

    # procs/ ----------------------------------------------------------------
    def register_process(self, proc: SimProcess) -> None:
        _write_atomic(self.procs_dir / f"{proc.pid}.json", asdict(proc))

    def update_memory(self, pid: int, memory_mib: int) -> SimProcess:
        """Change the memory a registered workload declares (it grew or shrank); atomic like
        every write here, so the backend reads the old figure or the new one."""
        path = self.procs_dir / f"{pid}.json"
        try:
            raw = json.loads(path.read_text())
            proc = SimProcess(int(raw["pid"]), int(raw["start_ticks"]), int(raw["gpu"]), memory_mib)
        except FileNotFoundError as err:
            raise SimulationError(f"process {pid} is not registered in {self.procs_dir}") from err
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SimulationError(f"{path} is unreadable: {err}") from err
        self.register_process(proc)
        return proc

    def unregister_process(self, pid: int) -> None:
        (self.procs_dir / f"{pid}.json").unlink(missing_ok=True)

    def processes(self) -> list[SimProcess]:
        procs: list[SimProcess] = []
        try:
            entries = sorted(self.procs_dir.glob("*.json"))
        except OSError as err:
            raise SimulationError(f"cannot list {self.procs_dir}: {err}") from err
        parsed: dict[Path, tuple[tuple[int, int, int], SimProcess]] = {}
        for path in entries:
            try:
                st = path.stat()
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                cached = self._parsed.get(path)
                if cached is not None and cached[0] == version:
                    proc = cached[1]
                else:
                    raw = json.loads(path.read_text())
                    proc = SimProcess(
                        int(raw["pid"]), int(raw["start_ticks"]), int(raw["gpu"]), int(raw["memory_mib"])
                    )
                parsed[path] = (version, proc)
                procs.append(proc)
            except FileNotFoundError:
                continue  # the workload exited between glob and read
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("ignoring malformed simulated workload file %s: %s", path, err)
        self._parsed = parsed
        return procs

    # events/ ---------------------------------------------------------------
    def post_event(self, gpu: int, kind: EventKind, xid: int | None = None, detail: str = "") -> Path:
        name = f"{time.time_ns():020d}-{os.getpid()}.json"
        path = self.events_dir / name
        _write_atomic(path, {"gpu": gpu, "kind": kind.value, "xid": xid, "detail": detail})
        return path

    def take_events(self) -> list[DeviceEvent]:
        """Consume pending events in the order they were posted."""
        events: list[DeviceEvent] = []
        try:
            entries = sorted(p for p in self.events_dir.glob("*.json"))
        except OSError as err:
            raise SimulationError(f"cannot list {self.events_dir}: {err}") from err
        for path in entries:
            try:
                raw = json.loads(path.read_text())
                xid = raw.get("xid")
                events.append(
                    DeviceEvent(
                        gpu_index=int(raw["gpu"]),
                        kind=EventKind(raw["kind"]),
                        xid=None if xid is None else int(xid),
                        detail=str(raw.get("detail") or "injected by the simulator"),
                    )
                )
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("dropping malformed simulated event %s: %s", path, err)
            path.unlink(missing_ok=True)
        return events
