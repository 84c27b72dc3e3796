"""MPS v3 namespaces bound to cgroups, as the simulated control daemon keeps them (protocol 3,
driver r615+/R620; docs/reference.md, "Newer drivers: MPS v3 and memory limits per cgroup";
docs/gpu-model.md "MPS v3").

What NVIDIA documents (MPS v3 Interface, Namespaces, Configuration File, r615/620 docs):
the daemon is started with ``-p 3``; a namespace subdivides a server's pinned memory limit,
active thread percentage and client priority for a group of clients; the verbs are
``namespace create/delete/list/set/get``; on R620 a client reaching the main control socket
is routed to a namespace by its cgroup (or its uid). A client's own
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` still only lowers what it is given.

ASSUMPTIONS (not in what was read; to check against ``nvidia-cuda-mps-control -p 3 -h`` on
a lent GPU with an r615+ driver, unverified on hardware):

- the option spelling: ``--name=``, ``--active-thread-percentage=``,
  ``--pinned-memory-limit=`` (the documented ``server create --uid=`` form) and the cgroup
  binding verb ``namespace bind --name=<ns> --cgroup=<path>``;
- a cgroup binding covers the processes of that cgroup and below it (the deepest binding
  wins);
- namespace administration is refused to a peer whose uid is not the daemon's own
  (:data:`ADMIN_VERBS`); without that, a tenant reaching the control socket would rebind
  itself, as on protocol 2 (NVIDIA k8s-device-plugin issue #1494).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agent.platform.gpu.sim.memory import within

ADMIN_VERBS = frozenset({"create", "delete", "set", "bind"})
DEFAULT = "default"


class NamespaceError(Exception):
    """A namespace command the daemon refuses (its text is the reply)."""


@dataclass
class Namespace:
    name: str
    percentage: float | None = None  # None: the server's
    pinned: int | None = None  # bytes of device 0; None: the server's
    cgroups: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class NamespaceCommand:
    verb: str
    options: dict[str, str]


def parse_namespace_command(args: list[str]) -> NamespaceCommand:
    """``namespace <verb> [--key=value ...]``'s words after ``namespace``."""
    if not args:
        raise NamespaceError("usage: namespace create|delete|list|set|get|bind [--key=value ...]")
    verb, options = args[0], {}
    for word in args[1:]:
        key, sep, value = word.partition("=")
        if not key.startswith("--") or not sep or not value:
            raise NamespaceError(f"{word!r}: options are --key=value")
        options[key[2:]] = value
    return NamespaceCommand(verb, options)


class Namespaces:
    """One server's namespaces (besides its implicit default, which is the server itself)."""

    def __init__(self) -> None:
        self.by_name: dict[str, Namespace] = {}
        # The implicit default namespace (``default`` names it, as in the documented
        # configuration file): where a client no binding covers goes.
        self.default = Namespace(DEFAULT)

    def route(self, cgroup: str) -> Namespace:
        """The namespace a client of ``cgroup`` is routed to."""
        best: tuple[int, Namespace] | None = None
        for ns in self.by_name.values():
            for bound in ns.cgroups:
                if within(cgroup, bound) and (best is None or len(bound) > best[0]):
                    best = (len(bound), ns)
        return self.default if best is None else best[1]

    def run(
        self,
        cmd: NamespaceCommand,
        parse_percentage: Callable[[str], float],
        parse_size: Callable[[str], int],
    ) -> str:
        """Run one namespace command; what the daemon prints."""
        if cmd.verb == "list":
            return "\n".join(sorted(self.by_name))
        name = cmd.options.get("name")
        if not name or "/" in name:
            raise NamespaceError(f"namespace {cmd.verb}: --name=<namespace> is required")
        if cmd.verb == "create":
            if name in self.by_name or name == DEFAULT:
                raise NamespaceError(f"namespace {name} exists")
            self.by_name[name] = Namespace(name)
            return ""
        ns = self.default if name == DEFAULT else self.by_name.get(name)
        if ns is None:
            raise NamespaceError(f"no namespace {name}")
        if ns is self.default and cmd.verb in ("delete", "bind"):
            raise NamespaceError(f"namespace {cmd.verb}: the default namespace cannot be {cmd.verb}ed")
        if cmd.verb == "delete":
            del self.by_name[name]
            return ""
        if cmd.verb == "get":
            pct = "-" if ns.percentage is None else f"{ns.percentage:.1f}"
            pinned = "0" if ns.pinned is None else f"{ns.pinned >> 20}M"
            return f"{pct} {pinned} {','.join(sorted(ns.cgroups)) or '-'}"
        if cmd.verb == "set":
            if "active-thread-percentage" in cmd.options:
                ns.percentage = parse_percentage(cmd.options["active-thread-percentage"])
            if "pinned-memory-limit" in cmd.options:
                size = parse_size(cmd.options["pinned-memory-limit"])
                ns.pinned = size or None
            return ""
        if cmd.verb == "bind":
            cgroup = cmd.options.get("cgroup", "")
            if not cgroup.startswith("/") or ".." in cgroup.split("/"):
                raise NamespaceError(f"namespace bind: --cgroup must be an absolute path, got {cgroup!r}")
            for other in self.by_name.values():
                other.cgroups.discard(cgroup.rstrip("/"))
            ns.cgroups.add(cgroup.rstrip("/"))
            return ""
        raise NamespaceError(f"unknown namespace verb {cmd.verb!r}")
