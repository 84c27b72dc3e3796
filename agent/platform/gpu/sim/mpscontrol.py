"""What an MPS control daemon keeps for its GPU, as NVIDIA documents it (docs/reference.md,
"The MPS control daemon"): the defaults, the servers (one per user id at a time), their
clients, and the commands of ``nvidia-cuda-mps-control``.

- **Defaults**: active thread percentage 100, no pinned device-memory limit.
  ``set_default_active_thread_percentage`` and ``set_default_device_pinned_mem_limit``
  apply to servers started afterwards; ``set_active_thread_percentage <server pid>`` and
  ``set_device_pinned_mem_limit <server pid>`` to that server's clients created afterwards.
  Existing clients keep what they started with.
- **A client's limits**: its own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` only lower what its server gives ("will only
  further constrain the limit set by the control daemon").
- **Servers per user id**: a client whose uid is the running server's joins it; with no
  server, one starts for its uid; with a server of another uid, it waits until that
  server's clients are done, then a server for its uid starts (the waiting clients of one
  uid join it together).
- **Anyone who reaches the control socket commands the daemon** (NVIDIA k8s-device-plugin
  issue #1494): on protocol 2 nothing here checks who sends a command.
- **Protocol 3** (``-p 3``, r615+/R620; :mod:`.mpsnamespaces`): namespaces bound to
  cgroups give a client its limits by the cgroup it runs in; its environment only lowers
  them. Commands that change settings are refused to a peer that is not the daemon's owner
  (an ASSUMPTION, see that module).

The daemon's own pid stands for its server's (one server runs at a time). Replies are what
the command prints: values for ``get_*``, nothing for a ``set_*`` that worked, a line
starting with ``Error`` otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agent.platform.gpu.mpspartition import parse_percentage
from agent.platform.gpu.sim.mpsnamespaces import (
    ADMIN_VERBS,
    NamespaceError,
    Namespaces,
    parse_namespace_command,
)

DEFAULT_PERCENTAGE = 100.0
_SIZE = re.compile(r"^(\d+)([KMGT]?)B?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CommandError(Exception):
    """A control command the daemon refuses (its text is the reply)."""


@dataclass
class Server:
    pid: int
    uid: int
    percentage: float
    pinned: dict[int, int]  # device ordinal -> bytes
    clients: set[int] = field(default_factory=set)  # client pids


@dataclass(frozen=True)
class ClientLimits:
    """What a client runs under: the lower of its server's and its own environment's."""

    percentage: float
    pinned_bytes: int | None  # of device 0, the one GPU the daemon serves


class MpsControl:
    """One GPU's control daemon state (see the module docstring). Not thread-safe."""

    def __init__(self, daemon_pid: int, protocol: int = 2) -> None:
        self.daemon_pid = daemon_pid
        self.protocol = protocol
        self.namespaces = Namespaces()  # protocol 3 only
        self.default_percentage = DEFAULT_PERCENTAGE
        self.default_pinned: dict[int, int] = {}
        self.server: Server | None = None
        self.waiting: dict[int, int] = {}  # client pid -> uid, in arrival order
        self.quit_requested = False

    # Clients --------------------------------------------------------------------------------
    def admit(
        self, pid: int, uid: int, env_percentage: float | None, env_pinned: int | None, cgroup: str = ""
    ) -> ClientLimits | None:
        """A client starts: its limits, or None while it waits for another uid's server
        (``cgroup``: its cgroup v2 directory, which routes it to a namespace on protocol 3)."""
        server = self.server
        if server is not None and server.uid != uid:
            if server.clients or any(u == server.uid for u in self.waiting.values()):
                self.waiting.setdefault(pid, uid)
                return None
            server = None  # an idle server of another uid: it shuts down for this client
        if server is None:
            server = self._start_server(uid)
        self.waiting.pop(pid, None)
        server.clients.add(pid)
        percentage, pinned = server.percentage, server.pinned.get(0)
        if self.protocol == 3:  # the daemon's side: nothing the client sets raises it
            namespace = self.namespaces.route(cgroup)
            if namespace.percentage is not None:
                percentage = namespace.percentage
            if namespace.pinned is not None:
                pinned = namespace.pinned
        if env_percentage is not None:
            percentage = min(percentage, env_percentage)
        if env_pinned is not None:
            pinned = env_pinned if pinned is None else min(pinned, env_pinned)
        return ClientLimits(percentage, pinned)

    def release(self, pid: int) -> None:
        """A client's context is gone (or it gave up waiting)."""
        self.waiting.pop(pid, None)
        if self.server is not None:
            self.server.clients.discard(pid)

    def may_admit(self, uid: int) -> bool:
        """Whether a client of ``uid`` that waits could start now."""
        server = self.server
        return server is None or server.uid == uid or not server.clients

    def _start_server(self, uid: int) -> Server:
        self.server = Server(self.daemon_pid, uid, self.default_percentage, dict(self.default_pinned))
        return self.server

    # Commands -------------------------------------------------------------------------------
    def command(self, line: str, *, owner: bool = True) -> str:
        """Run one command line; what nvidia-cuda-mps-control prints for it (``owner``:
        the sender runs as the daemon's own uid)."""
        words = line.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        if self.protocol == 3:
            refused = self._v3_refusal(name, args, owner)
            if refused is not None:
                return f"Error: {refused}"
            if name == "namespace":
                try:
                    return self.namespaces.run(parse_namespace_command(args), _percentage, parse_size)
                except (NamespaceError, CommandError) as err:
                    return f"Error: {err}"
        handler = _COMMANDS.get(name)
        if handler is None:
            return f"Error: unknown command {name!r}"
        try:
            return handler(self, args)
        except CommandError as err:
            return f"Error: {err}"

    @staticmethod
    def _v3_refusal(name: str, args: list[str], owner: bool) -> str | None:
        """Why a protocol-3 daemon refuses this command from this peer (None: it runs it)."""
        if owner:
            return None
        changes = (name == "namespace" and bool(args) and args[0] in ADMIN_VERBS) or (
            name != "namespace" and not name.startswith("get_")
        )
        return "permission denied: only the daemon's owner changes its settings" if changes else None

    def _server_arg(self, args: list[str], count: int) -> Server:
        """The server the first of ``count`` arguments names."""
        if len(args) != count:
            raise CommandError(f"expected {count} argument(s), got {len(args)}")
        pid = _int(args[0], "server PID")
        if self.server is None or self.server.pid != pid:
            raise CommandError(f"no server with PID {pid}")
        return self.server

    def _get_server_list(self, args: list[str]) -> str:
        return "" if self.server is None else str(self.server.pid)

    def _get_client_list(self, args: list[str]) -> str:
        return "\n".join(str(p) for p in sorted(self._server_arg(args, 1).clients))

    def _start_server_command(self, args: list[str]) -> str:
        if len(args) != 2 or args[0] != "-uid":
            raise CommandError("usage: start_server -uid <user id>")
        uid = _int(args[1], "user id")
        if self.server is not None:
            if self.server.uid == uid:
                return ""
            if self.server.clients:
                raise CommandError(f"a server for user {self.server.uid} runs with clients")
        self._start_server(uid)
        return ""

    def _quit(self, args: list[str]) -> str:
        self.quit_requested = True
        return ""

    def _set_default_percentage(self, args: list[str]) -> str:
        if len(args) != 1:
            raise CommandError("usage: set_default_active_thread_percentage <percentage>")
        self.default_percentage = _percentage(args[0])
        return ""

    def _get_default_percentage(self, args: list[str]) -> str:
        return f"{self.default_percentage:.1f}"

    def _set_percentage(self, args: list[str]) -> str:
        server = self._server_arg(args, 2)
        server.percentage = _percentage(args[1])
        return ""

    def _get_percentage(self, args: list[str]) -> str:
        return f"{self._server_arg(args, 1).percentage:.1f}"

    def _set_default_pinned(self, args: list[str]) -> str:
        if len(args) != 2:
            raise CommandError("usage: set_default_device_pinned_mem_limit <device> <value>")
        _set_limit(self.default_pinned, args[0], args[1])
        return ""

    def _get_default_pinned(self, args: list[str]) -> str:
        if len(args) != 1:
            raise CommandError("usage: get_default_device_pinned_mem_limit <device>")
        return _show_limit(self.default_pinned.get(_int(args[0], "device")))

    def _set_pinned(self, args: list[str]) -> str:
        _set_limit(self._server_arg(args, 3).pinned, args[1], args[2])
        return ""

    def _get_pinned(self, args: list[str]) -> str:
        return _show_limit(self._server_arg(args, 2).pinned.get(_int(args[1], "device")))


_COMMANDS = {
    "get_server_list": MpsControl._get_server_list,
    "get_client_list": MpsControl._get_client_list,
    "start_server": MpsControl._start_server_command,
    "quit": MpsControl._quit,
    "set_default_active_thread_percentage": MpsControl._set_default_percentage,
    "get_default_active_thread_percentage": MpsControl._get_default_percentage,
    "set_active_thread_percentage": MpsControl._set_percentage,
    "get_active_thread_percentage": MpsControl._get_percentage,
    "set_default_device_pinned_mem_limit": MpsControl._set_default_pinned,
    "get_default_device_pinned_mem_limit": MpsControl._get_default_pinned,
    "set_device_pinned_mem_limit": MpsControl._set_pinned,
    "get_device_pinned_mem_limit": MpsControl._get_pinned,
}


def parse_size(text: str) -> int:
    """``2G``, ``1024M``, ``512`` (MiB when no unit is given, as the daemon reads it)."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise CommandError(f"{text!r} is not a size like 1024M or 2G")
    number, unit = int(match.group(1)), match.group(2).upper()
    return number * (_UNITS[unit] if unit else _UNITS["M"])


def _set_limit(limits: dict[int, int], device: str, value: str) -> None:
    ordinal = _int(device, "device")
    size = parse_size(value)
    if size == 0:
        limits.pop(ordinal, None)
    else:
        limits[ordinal] = size


def _show_limit(value: int | None) -> str:
    return "0" if value is None else f"{value >> 20}M"


def _percentage(text: str) -> float:
    try:
        return parse_percentage(text)
    except ValueError as err:
        raise CommandError(f"percentage {err}") from err


def _int(text: str, what: str) -> int:
    if not text.isdigit():
        raise CommandError(f"{what} {text!r} is not a number")
    return int(text)
