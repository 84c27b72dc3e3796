"""The simulated node's directory, where the GPU server and its clients meet:

    <dir>/node.json   the node the server simulates: its GPUs and how it runs them
    <dir>/gpu.sock    the server's socket (workloads, the agent's backend, sim-event)
    <dir>/agent.lock  held (flock) by the one agent that uses the node

node.json is written by the server once its socket listens (atomically: a reader sees the
whole file or none) and removed when it stops.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.errors import PlatformError, SimulationError
from agent.platform.atomicfile import write_atomic

NODE_FILE = "node.json"
SOCKET_FILE = "gpu.sock"
LOCK_FILE = "agent.lock"


@dataclass(frozen=True)
class SimGpuSlot:
    """One simulated GPU as the server runs it."""

    index: int
    uuid: str
    model: str  # NVML product name
    memory_mib: int
    sample_period_s: float
    mps: bool
    nvml_aggregation: str = "per-sample"  # what the NVML library makes of the driver's samples
    ring: bool = True  # the driver keeps its per-process samples in the perfmon ring (driver view)


@dataclass(frozen=True)
class SimNode:
    node_name: str
    spec: str
    server_pid: int
    gpus: tuple[SimGpuSlot, ...]

    def gpu(self, index: int) -> SimGpuSlot:
        for slot in self.gpus:
            if slot.index == index:
                return slot
        raise SimulationError(f"the simulated node has no GPU {index} (GPUs 0..{len(self.gpus) - 1})")


class SimNodeDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node_file = root / NODE_FILE
        self.socket = root / SOCKET_FILE
        self.lock_file = root / LOCK_FILE

    def create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SimulationError(f"cannot create the simulated node's directory {self.root}: {err}") from err

    def write_node(self, node: SimNode) -> None:
        write_json(self.node_file, asdict(node))

    def read_node(self) -> SimNode:
        try:
            raw = json.loads(self.node_file.read_text())
            gpus = tuple(
                SimGpuSlot(
                    int(g["index"]),
                    str(g["uuid"]),
                    str(g["model"]),
                    int(g["memory_mib"]),
                    float(g["sample_period_s"]),
                    bool(g["mps"]),
                    str(g.get("nvml_aggregation", "per-sample")),
                    bool(g.get("ring", True)),
                )
                for g in raw["gpus"]
            )
            return SimNode(str(raw["node_name"]), str(raw["spec"]), int(raw["server_pid"]), gpus)
        except FileNotFoundError as err:
            raise SimulationError(
                f"no simulated GPU node at {self.root}: start `vcuda-agent run --simulate SPEC` "
                "(or `vcuda-agent sim-gpu`) first, or pass the same --sim-state-dir"
            ) from err
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SimulationError(f"{self.node_file} is unreadable: {err}") from err

    def remove_node(self, server_pid: int) -> None:
        """Remove node.json and the socket if they are still this server's."""
        try:
            if self.read_node().server_pid != server_pid:
                return
        except SimulationError:
            return
        self.node_file.unlink(missing_ok=True)
        self.socket.unlink(missing_ok=True)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (:func:`agent.platform.atomicfile.write_atomic`), readable by its owner."""
    try:
        write_atomic(path, json.dumps(payload).encode(), mode=0o600)
    except PlatformError as err:
        raise SimulationError(str(err)) from err


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
