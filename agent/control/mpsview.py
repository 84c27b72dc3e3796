"""What the MPS sharing layer publishes for the control loop and status to read.

The control loop asks every period, per GPU, whether its clients run concurrently (MPS
clients are not held by turns), and per container, the share the freezer holds an
untrusted MPS v3 share to. Those answers must never wait for a daemon, a v3 command, a
file or a lock that such slow work holds (:mod:`.mpssharing` holds its locks across them).
So the sharing layer publishes a :class:`SharingView` (frozen, its mappings read-only
copies) each time its grants, refusals or trust change, by replacing one reference, and
the readers take that reference and read it without any lock: in CPython a reference
swap is atomic, and a reader sees one whole view, the one before a change or the one
after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from agent.control.mpsgrants import MpsGrant
from agent.control.mpstrust import NamespaceTrust
from agent.platform.mpsdaemon import DaemonState, DaemonStatus, MpsDaemon


@dataclass(frozen=True)
class SharingView:
    """One consistent state of the node's MPS shares (keys ``pod uid/container``); made by
    :func:`build_view`."""

    grants: Mapping[str, MpsGrant]
    concurrent: frozenset[int]  # GPUs whose shares run as MPS clients
    blind: Mapping[str, float]  # untrusted v3 share -> the percent of its GPU the freezer holds it to
    untrusted: Mapping[str, str]  # untrusted v3 share -> why
    refused: Mapping[str, str]  # share given no grant by its pod spec (MPS v3) -> why


def build_view(
    grants: Mapping[str, MpsGrant],
    trust: NamespaceTrust | None,
    refused: Mapping[str, str],
) -> SharingView:
    """The view of these grants: ``blind`` and ``untrusted`` hold the v3 shares (those with a
    namespace) that ``trust`` does not trust to it, with the share of the GPU the freezer
    holds each to (its grant's effective percentage) and why; ``refused``: the shares
    their pod spec got no grant, and why."""
    copied = dict(grants)
    untrusted: dict[str, str] = {}
    if trust is not None:
        for key, grant in copied.items():
            why = trust.why_not(key) if grant.namespace is not None else None
            if why is not None:
                untrusted[key] = why
    return SharingView(
        grants=MappingProxyType(copied),
        concurrent=frozenset(g.gpu for g in copied.values()),
        blind=MappingProxyType({k: copied[k].partition.effective_percent for k in untrusted}),
        untrusted=MappingProxyType(untrusted),
        refused=MappingProxyType(dict(refused)),
    )


@dataclass(frozen=True)
class GpuSharing:
    """How one GPU's shares are held, and why (status)."""

    gpu: int
    actuator: str  # "mps" or "freezer"
    reason: str
    daemon: DaemonStatus | None


def gpu_sharing(
    index: int,
    daemon: MpsDaemon,
    why_not: str | None,
    mixed: list[int] | None,
    view: SharingView,
    *,
    v3: bool,
) -> GpuSharing:
    """GPU ``index``'s line in status: ``why_not``, why its shares cannot use MPS (None:
    they can); ``mixed``, the user ids of its MPS clients where there are several."""
    if why_not is not None:
        return GpuSharing(index, "freezer", why_not, daemon.status())
    if mixed:
        uids = ", ".join(map(str, mixed))
        why = f"clients run as user ids {uids}: MPS serves one uid at a time, the others wait"
        return GpuSharing(index, "mps", why, daemon.status())
    if daemon.state is DaemonState.STOPPED:
        return GpuSharing(index, "mps", "no share on it yet: its daemon starts at the first", None)
    detail = ""
    if v3:
        whys = sorted((k, why) for k, why in view.untrusted.items() if view.grants[k].gpu == index)
        detail = "; MPS v3: limits on the daemon's side per share cgroup (enforceable)"
        detail += "".join(f"; {k}: {why}" for k, why in whys)
    return GpuSharing(index, "mps", f"control daemon {daemon.state}{detail}", daemon.status())
