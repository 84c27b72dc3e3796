"""Which MPS v3 shares are trusted to the namespace limits the agent set for them.

A v3 daemon refuses namespace administration to a peer whose uid is not its own (an
ASSUMPTION, :mod:`agent.platform.gpu.sim.mpsnamespaces`), and every client must reach its
control socket. The daemon runs as the agent's user (root): a container process that runs
as that uid is the daemon's owner as far as the daemon can tell, and can set any namespace
of that daemon, its own included. So a share is trusted to its namespace only once a
reading of its processes' uids (real, effective, saved, filesystem: any it may switch to)
shows none that is the daemon's; until then (no process read yet), and for good once one
of them, or a process of another share on the same daemon (which could raise this share's
namespace for it), was seen with the daemon's uid, the freezer holds it.

Readings come once a second: a process that ran as the daemon's uid and exited, or
dropped to another uid, between two readings is not seen (docs/enforcement.md "MPS v3").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.control.mpsgrants import MpsGrant

log = logging.getLogger(__name__)

PENDING = (
    "no process of it read yet: not trusted to its MPS v3 namespace until one shows a uid other "
    "than the MPS daemon's; held by the freezer"
)


@dataclass(frozen=True)
class Moved:
    """A share no longer trusted to its namespace (for the log)."""

    key: str
    why: str
    was_trusted: bool  # it ran on its namespace limit until now


def read_uids(
    grants: Sequence[tuple[str, MpsGrant]], uids_of: Callable[[str, str], frozenset[int]] | None
) -> dict[str, tuple[int, frozenset[int]]]:
    """The uids of every share with a namespace (``uids_of(pod uid, container)``; None:
    nothing to read them by, so none will be trusted): key -> (GPU, uids)."""
    readings = {}
    for key, grant in grants:
        if grant.namespace is not None:
            pod_uid, _, container = key.partition("/")
            readings[key] = (grant.gpu, uids_of(pod_uid, container) if uids_of is not None else frozenset())
    return readings


def mixed_users(
    grants: Sequence[tuple[str, MpsGrant]], users_of: Callable[[str, str], frozenset[int]]
) -> dict[int, tuple[list[str], list[int]]]:
    """Per GPU whose MPS clients run as more than one user id (``users_of(pod uid,
    container)``: the real uids of its processes): the shares whose uids were read, and the
    uids. MPS runs one server per uid: a client of another uid than the running server's
    waits, silently, until that server's clients are done (docs/reference.md, "The MPS control
    daemon")."""
    by_gpu: dict[int, dict[str, frozenset[int]]] = {}
    for key, grant in grants:
        pod_uid, _, container = key.partition("/")
        by_gpu.setdefault(grant.gpu, {})[key] = users_of(pod_uid, container)
    mixed = {}
    for gpu, users in by_gpu.items():
        uids = sorted(set().union(*users.values()))
        if len(uids) > 1:
            mixed[gpu] = (sorted(k for k, u in users.items() if u), uids)
    return mixed


class NamespaceTrust:
    """The trust decisions of one node's v3 shares, keyed ``pod uid/container``. Not
    thread-safe: the sharing layer's state lock serialises its callers."""

    def __init__(self, daemon_uid: int) -> None:
        self.daemon_uid = daemon_uid
        self._trusted: set[str] = set()
        self._refused: dict[str, str] = {}  # key -> why; kept until the share goes

    def update(self, readings: Mapping[str, tuple[int, frozenset[int]]]) -> list[Moved]:
        """One reading of every v3 share: key -> (GPU, its processes' uids; empty: none
        read). Returns (and logs) the shares that lost trust now."""
        for key in (self._trusted | self._refused.keys()) - readings.keys():
            self._trusted.discard(key)
            self._refused.pop(key, None)
        owners: dict[int, list[str]] = {}
        for key, (gpu, uids) in sorted(readings.items()):
            if self.daemon_uid in uids:
                owners.setdefault(gpu, []).append(key)
        moved = []
        for key, (gpu, uids) in sorted(readings.items()):
            if key in self._refused:
                continue
            on_gpu = owners.get(gpu, [])
            if key in on_gpu:
                why = (
                    f"runs as uid {self.daemon_uid}, the MPS daemon's user: it could change its own "
                    "namespace's limit; held by the freezer"
                )
            elif on_gpu:
                why = (
                    f"{on_gpu[0]} on the same GPU runs as uid {self.daemon_uid}, the MPS daemon's "
                    "user: it could change this share's namespace's limit too; held by the freezer"
                )
            else:
                if uids:
                    self._trusted.add(key)
                continue
            moved.append(Moved(key, why, key in self._trusted))
            self._trusted.discard(key)
            self._refused[key] = why
        for m in moved:
            before = "was on its namespace limit until now" if m.was_trusted else "not trusted before either"
            log.warning("MPS v3: %s %s (%s)", m.key, m.why, before)
        return moved

    def why_not(self, key: str) -> str | None:
        """Why the share is not trusted to its namespace (None: it is)."""
        if key in self._refused:
            return self._refused[key]
        return None if key in self._trusted else PENDING


TIME_SLICED = "time-sliced and held by the freezer"


class SpecRefusals:
    """MPS v3 shares given no grant at Allocate because their pod spec does not prove they
    cannot run as root (no pipe mount: they cannot reach the control socket at all), and the
    GPUs they keep time-sliced. A GPU serves MPS clients or time-sliced contexts, not both:
    with EXCLUSIVE_PROCESS (advised for MPS, and what the engine models) a context that does
    not come through the daemon is refused, and in DEFAULT compute mode it time-slices with
    the MPS server, taking its slices from every client's share. So a share that arrives on a
    GPU holding a time-sliced share is time-sliced too (the daemon would not attach beside its
    context). Not thread-safe: :class:`MpsSharing` calls it under its state lock."""

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[int, str]] = {}  # key -> (GPU, why)

    def decide(self, key: str, gpu: int, risk: str | None, serving: Sequence[str]) -> str | None:
        """Why ``key`` gets no grant (None: it may have one). ``risk``: why its spec may run
        as root; ``serving``: the MPS clients its GPU's daemon already serves."""
        why = None
        if risk is not None:
            why = f"{risk}: could change its own MPS namespace; {TIME_SLICED}"
            if serving:
                why += (
                    f" (its GPU already serves MPS clients, {', '.join(serving)}: under EXCLUSIVE_PROCESS"
                    " its CUDA context is refused; in DEFAULT compute mode it time-slices with the MPS"
                    " server)"
                )
        elif not serving:  # where the daemon serves clients already, the next one joins them
            others = sorted(k for k, (g, _w) in self._by_key.items() if g == gpu and k != key)
            if others:
                why = (
                    f"GPU {gpu} holds {others[0]}, time-sliced (its spec may run as root): MPS clients and "
                    f"time-sliced contexts do not share a GPU; {TIME_SLICED}"
                )
        if why is None:
            self._by_key.pop(key, None)
        else:
            self._by_key[key] = (gpu, why)
        return why

    def why(self, key: str) -> str | None:
        found = self._by_key.get(key)
        return None if found is None else found[1]

    def snapshot(self) -> dict[str, str]:
        """Every refused share and why (a copy)."""
        return {k: why for k, (_gpu, why) in self._by_key.items()}

    def keep(self, live: Callable[[str], bool]) -> None:
        self._by_key = {k: v for k, v in self._by_key.items() if live(k)}
