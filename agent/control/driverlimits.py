"""GPU memory quotas enforced by the driver where it can (``nvmlDeviceSetMemoryLimits_v1``).

For every share with a vcuda-memory quota whose cgroup v2 directory exists, the driver gets
a hard limit of that many MiB for the container's cgroup: an allocation over it then fails
with out-of-memory inside the container, and nothing is killed. Where the driver cannot
(an older driver, cgroup v1 only, the call fails for a container), the memory guard's
kill / deny / audit stays what holds the quota; the guard keeps watching every container
either way, so a limit that did not take is still caught.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.domain.specs import EnforcementSpec
from agent.errors import VcudaError
from agent.platform.gpu.inventory import GpuBackend

log = logging.getLogger(__name__)

MIB = 1 << 20


class DriverMemoryLimits:
    def __init__(
        self,
        backend: GpuBackend,
        locate: Callable[[EnforcementSpec], Path | None],
        *,
        unavailable: str | None,
    ) -> None:
        """``unavailable``: why the node cannot have driver limits at all (None: it can)."""
        self._backend = backend
        self._locate = locate
        self.unavailable = unavailable
        self._lock = threading.Lock()
        self._applied: dict[str, tuple[Path, int]] = {}  # label -> (cgroup, MiB)
        self._failed: dict[str, str] = {}  # label -> why its limit could not be set

    def apply(self, specs: Iterable[EnforcementSpec]) -> None:
        """Set the limit of every quota'd container not yet limited (or whose quota changed)."""
        if self.unavailable is not None:
            return
        seen: set[str] = set()
        for spec in specs:
            if spec.memory_quota_mib is None or not spec.container_id or not spec.gpus:
                continue
            seen.add(spec.label)
            with self._lock:
                done = self._applied.get(spec.label)
                failed = spec.label in self._failed
            if failed or (done is not None and done[1] == spec.memory_quota_mib):
                continue
            cgroup = self._locate(spec)
            if cgroup is None:
                continue  # not started yet: the next check
            self._set(spec, cgroup)
        with self._lock:
            for label in [k for k in self._applied if k not in seen]:
                del self._applied[label]  # the cgroup went with the container, and its limit
            for label in [k for k in self._failed if k not in seen]:
                del self._failed[label]

    def _set(self, spec: EnforcementSpec, cgroup: Path) -> None:
        quota = spec.memory_quota_mib
        assert quota is not None
        try:
            self._backend.set_memory_limit(spec.gpus[0], cgroup, quota * MIB)
        except VcudaError as err:
            with self._lock:
                self._failed[spec.label] = str(err)
            log.warning(
                "%s: no driver memory limit (%s); its quota is held by the memory guard", spec.label, err
            )
            return
        with self._lock:
            self._applied[spec.label] = (cgroup, quota)
        log.info("%s: the driver limits its GPU memory to %d MiB (%s)", spec.label, quota, cgroup)

    def holder(self, label: str) -> tuple[bool, str]:
        """(True, how) when the driver limits this container's memory, else (False, why not)."""
        if self.unavailable is not None:
            return False, self.unavailable
        with self._lock:
            applied = self._applied.get(label)
            failed = self._failed.get(label)
        if applied is not None:
            return True, f"driver limit {applied[1]} MiB on {applied[0]}"
        return False, failed or "not set yet"
