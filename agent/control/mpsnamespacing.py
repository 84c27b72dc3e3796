"""MPS v3 limits on the daemon's side: one namespace per share, bound to the share's
container cgroup, so that what the tenant sets in its own environment cannot raise them
(:mod:`agent.platform.mpsv3`; unverified on hardware until a lent GPU has an r615+ driver).

Per GPU daemon, once it is up: the default namespace (where a client goes that no binding
covers, e.g. one that initialises CUDA before the agent has seen its cgroup) is set to
:data:`FLOOR_PERCENT`, so an unbound client runs at least as low as any grant. Per share, at
Allocate: its namespace is created with the share's percentage and memory limit; once the
container's cgroup is known (at Allocate when it already exists, else on a later tick), it
is bound to it. A namespace the daemon refuses leaves the share to the freezer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.platform import mpsv3

log = logging.getLogger(__name__)

FLOOR_PERCENT = 1  # the daemon rounds it up to its smallest partition (one TPC's worth)


class NamespaceBinder:
    """The namespaces the agent made on the GPUs' v3 daemons. The caller serialises the calls
    for one daemon (:class:`~agent.control.mpssharing.MpsSharing` holds that GPU's lock);
    calls for different daemons may run at once, and the commands run outside the binder's
    own lock, which guards its records only."""

    def __init__(
        self,
        daemon_command: Sequence[str],
        *,
        environ: Mapping[str, str] | None = None,
        run: mpsv3.Runner | None = None,
    ) -> None:
        """``environ``: the commands' environment (None: the agent's); ``run``: what runs them
        (None: subprocess.run; tests pass a stand-in)."""
        self._command = list(daemon_command)
        self._environ = None if environ is None else dict(environ)
        self._run = run
        self._lock = threading.Lock()
        self._floored: dict[Path, int] = {}  # pipe dir -> the daemon pid whose default is floored
        self._bound: dict[str, Path] = {}  # share key -> the cgroup its namespace is bound to

    def _send(self, pipe_dir: Path, words: Sequence[str]) -> str | None:
        return mpsv3.send(self._command, pipe_dir, words, environ=self._environ, run=self._run)

    def bound(self, key: str) -> Path | None:
        """The cgroup the share's namespace is bound to (None: not bound yet)."""
        with self._lock:
            return self._bound.get(key)

    def _set_bound(self, key: str, cgroup: Path | None) -> None:
        with self._lock:
            self._bound.pop(key, None)
            if cgroup is not None:
                self._bound[key] = cgroup

    def prepare(self, pipe_dir: Path, daemon_pid: int | None) -> str | None:
        """Floor the default namespace of the daemon at ``pipe_dir`` (once per daemon)."""
        with self._lock:
            if daemon_pid is not None and self._floored.get(pipe_dir) == daemon_pid:
                return None
        words = [
            w.format(name="default", percent=FLOOR_PERCENT) for w in mpsv3.NAMESPACE_COMMANDS["percentage"]
        ]
        why = self._send(pipe_dir, words)
        if why is None and daemon_pid is not None:
            with self._lock:
                self._floored[pipe_dir] = daemon_pid
        return why

    def create(
        self, key: str, pipe_dir: Path, percent: int, memory_mib: int | None, cgroup: Path | None
    ) -> str | None:
        """The share's namespace with its limits (bound to ``cgroup`` when known); why not."""
        name = mpsv3.namespace_name(*key.split("/", 1))
        for words in mpsv3.namespace_commands(name, percent, memory_mib, cgroup):
            why = self._send(pipe_dir, words)
            if why is not None and not (words[1] == "create" and "exists" in why):
                return why  # an agent restart finds its namespaces still there: that is fine
        self._set_bound(key, cgroup)
        return None

    def bind(self, key: str, pipe_dir: Path, cgroup: Path) -> str | None:
        """Bind the share's namespace to its container's cgroup; why not."""
        if self.bound(key) == cgroup:
            return None
        name = mpsv3.namespace_name(*key.split("/", 1))
        words = [w.format(name=name, cgroup=cgroup) for w in mpsv3.NAMESPACE_COMMANDS["bind"]]
        why = self._send(pipe_dir, words)
        if why is None:
            self._set_bound(key, cgroup)
            log.info("MPS v3: namespace %s of %s bound to %s", name, key, cgroup)
        return why

    def open_up(self, key: str, pipe_dir: Path) -> str | None:
        """The share's namespace at 100 %: the freezer holds it alone (:mod:`.mpstrust`); why not."""
        name = mpsv3.namespace_name(*key.split("/", 1))
        return self._send(
            pipe_dir, [w.format(name=name, percent=100) for w in mpsv3.NAMESPACE_COMMANDS["percentage"]]
        )

    def delete(self, key: str, pipe_dir: Path) -> None:
        """The share is gone: so is its namespace (a daemon that went is no error)."""
        self._set_bound(key, None)
        name = mpsv3.namespace_name(*key.split("/", 1))
        why = self._send(pipe_dir, [w.format(name=name) for w in mpsv3.NAMESPACE_COMMANDS["delete"]])
        if why is not None:
            log.info("MPS v3: namespace %s of %s not deleted: %s", name, key, why)
