"""Whether a container's pod spec proves it can neither run as root nor become root.

MPS v3 trusts a share to its daemon-side namespace only if none of its processes can run as
the daemon's uid (root): such a process may change its own namespace through the control
socket. The kubelet enforces the securityContext before the container's first process, so
the spec decides before any process exists. Pod specs are tenant input: anything absent,
of the wrong type or contradictory counts as "may be root" (never an error).

Proven non-root needs all of:
- an effective ``runAsUser`` other than 0, or an effective ``runAsNonRoot: true`` (the
  kubelet then refuses to start an image whose user is root); the container's
  securityContext overrides the pod's, field by field; an effective ``runAsUser: 0`` is
  root whatever ``runAsNonRoot`` says;
- the container's ``allowPrivilegeEscalation: false`` (no pod-level field; without it a
  setuid-root binary makes the process root again);
- not ``privileged`` and no ``SYS_ADMIN`` capability added (the kubelet treats both as
  escalation allowed, whatever ``allowPrivilegeEscalation`` says).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HOW = "runAsNonRoot/runAsUser and allowPrivilegeEscalation: false"
NO_SPEC = f"may run as root (no pod spec seen; needs {HOW})"


def root_risk(pod_context: Any, container_context: Any) -> str | None:
    """Why a container may run as root or become root (None: its spec proves it cannot)."""
    if pod_context is not None and not isinstance(pod_context, Mapping):
        return f"may run as root (pod securityContext is not an object; needs {HOW})"
    if container_context is not None and not isinstance(container_context, Mapping):
        return f"may run as root (securityContext is not an object; needs {HOW})"
    pod, ctr = pod_context or {}, container_context or {}
    if ctr.get("privileged") is not None and ctr.get("privileged") is not False:
        return "may become root (privileged)"
    if _adds_sys_admin(ctr.get("capabilities")):
        return "may become root (capability SYS_ADMIN added, or capabilities malformed)"
    user = _effective(pod, ctr, "runAsUser")
    non_root = _effective(pod, ctr, "runAsNonRoot")
    if user is not None and (isinstance(user, bool) or not isinstance(user, int) or user < 0):
        return f"may run as root (runAsUser {user!r} is not a user id)"
    if non_root is not None and not isinstance(non_root, bool):
        return f"may run as root (runAsNonRoot {non_root!r} is not a boolean)"
    if user == 0:
        return "runs as root (runAsUser: 0)"
    if user is None and non_root is not True:
        return f"may run as root (no runAsNonRoot/runAsUser and allowPrivilegeEscalation: false; needs {HOW})"
    if ctr.get("allowPrivilegeEscalation") is not False:
        return "may become root (allowPrivilegeEscalation is not false: a setuid-root program runs as root)"
    return None


def _effective(pod: Mapping[str, Any], ctr: Mapping[str, Any], name: str) -> Any:
    return ctr[name] if ctr.get(name) is not None else pod.get(name)


def _adds_sys_admin(capabilities: Any) -> bool:
    if capabilities is None:
        return False
    if not isinstance(capabilities, Mapping):
        return True
    added = capabilities.get("add") or []
    if not isinstance(added, list):
        return True
    escalating = {"SYS_ADMIN", "ALL"}
    return any(not isinstance(c, str) or c.upper().removeprefix("CAP_") in escalating for c in added)
