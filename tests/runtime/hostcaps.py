"""What this host's root may do that a runtime needs, read from /proc, for cells of the
matrix that cannot run here for a reason outside the agent and the runtime's own code."""

from __future__ import annotations

import resource
from pathlib import Path

from tests.runtime.containerd import PrivateContainerd

CAP_SYS_RESOURCE = 24


def has_capability(bit: int, status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process's effective set holds capability ``bit`` (capabilities(7))."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def crun_v2_blocker(containerd: PrivateContainerd) -> str | None:
    """Why crun cannot start a container on cgroup v2 here, or None when it can.

    crun (1.8) raises RLIMIT_MEMLOCK to unlimited before it loads its v2 device program,
    and fails the container when that is refused. Raising a hard limit needs CAP_SYS_RESOURCE;
    a sandbox that drops it from root's bounding set (this VM does) cannot run crun on v2
    at all, whatever the agent does. The container is tried, and only that exact failure
    counts: anything else fails the test like any other runtime error."""
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if has_capability(CAP_SYS_RESOURCE) or hard == resource.RLIM_INFINITY:
        return None
    try:
        containerd.run()
    except RuntimeError as err:
        if "setrlimit (RLIM_MEMLOCK)" not in str(err):
            raise
        return (
            f"crun on cgroup v2 needs CAP_SYS_RESOURCE here: it raises RLIMIT_MEMLOCK (hard limit "
            f"{hard >> 10} KiB) to unlimited before loading its device program, and this host's "
            f"root lacks the capability ({str(err).rsplit(': ', 2)[-2]})"
        )
    return None
