"""Whether a pod can take every GPU by setting NVIDIA_VISIBLE_DEVICES in its own env.

kubelet puts a pod's env after Allocate's, so a pod's ``NVIDIA_VISIBLE_DEVICES=all`` wins
over the agent's narrowed value; the NVIDIA container runtime (its legacy hook and its CDI
mode alike) then hands the container every GPU unless the toolkit's config says
``accept-nvidia-visible-devices-envvar-when-unprivileged = false`` (true when unset;
nvidia-container-toolkit internal/modifier/cdi.go and the runtime hook's getDevices). With
it false, an unprivileged container's variable is ignored; privileged ones are always
honoured (such a pod owns the node anyway). ``mode = "cdi"`` alone does not close it.

The verdict: ``open``, ``closed`` or ``unknown`` (no config found, or one that cannot be
read), with the reason, given the agent's own device-list strategy: ``envvar`` needs the
variable honoured, so with it the hole cannot be closed without breaking GPU pods.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.platform.toolkitconfig import ENVVAR_KEY, VOLUME_MOUNTS_KEY, ToolkitConfigFile

_FIX = f"set {ENVVAR_KEY} = false in the toolkit's config.toml (deploy/README.md)"
_OTHER_STRATEGY = "run the agent with --device-list-strategy mounts or cdi"


class HoleState(enum.StrEnum):
    OPEN = "open"
    CLOSED = "closed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class HoleVerdict:
    state: HoleState
    detail: str


def envvar_hole(files: Sequence[ToolkitConfigFile], strategy: str) -> HoleVerdict:
    """The verdict over every candidate config (the node may run either): open if any
    present one leaves it open, unknown if any cannot be read, closed if all close it."""
    present = [f for f in files if not f.absent]
    if not present:
        where = ", ".join(str(f.path) for f in files) or "no path given"
        return HoleVerdict(
            HoleState.UNKNOWN,
            f"no NVIDIA container toolkit config ({where}): without the NVIDIA runtime on this "
            "node there is no such hole; if its config is elsewhere, name it with --nvidia-toolkit-config",
        )
    opened: list[str] = []
    unknown: list[str] = []
    closed: list[str] = []
    notes: list[str] = []
    for f in present:
        state, text = _one(f)
        {HoleState.OPEN: opened, HoleState.UNKNOWN: unknown, HoleState.CLOSED: closed}[state].append(text)
        if f.problem is None and f.values.get(VOLUME_MOUNTS_KEY) is True:
            notes.append(
                f"{f.path}: {VOLUME_MOUNTS_KEY} = true: a pod allowed a hostPath of /dev/null can still "
                "ask for GPUs by mount path (/var/run/nvidia-container-devices/...); forbid hostPath "
                "(Pod Security baseline)"
            )
    if opened:
        if strategy == "envvar":
            why = (
                "the envvar strategy needs this: the NVIDIA runtime picks GPUs from NVIDIA_VISIBLE_DEVICES, "
                f"the agent's or the pod's own; {_OTHER_STRATEGY}, then {_FIX}"
            )
        else:
            why = (
                "a pod that sets NVIDIA_VISIBLE_DEVICES=all in its env gets every GPU from the NVIDIA "
                f"runtime, past its allocation; {_FIX}"
            )
        return HoleVerdict(HoleState.OPEN, "; ".join([*opened, why, *notes]))
    if unknown:
        return HoleVerdict(HoleState.UNKNOWN, "; ".join([*unknown, *notes]))
    if strategy == "envvar":
        conflict = (
            "but the envvar strategy relies on it: the NVIDIA runtime ignores the agent's "
            "NVIDIA_VISIBLE_DEVICES too, so GPU pods get device nodes without driver files; "
            f"{_OTHER_STRATEGY}"
        )
        return HoleVerdict(HoleState.CLOSED, "; ".join([*closed, conflict, *notes]))
    return HoleVerdict(HoleState.CLOSED, "; ".join([*closed, *notes]))


def _one(f: ToolkitConfigFile) -> tuple[HoleState, str]:
    if f.problem is not None:
        return HoleState.UNKNOWN, f"{f.path}: {f.problem}"
    if ENVVAR_KEY not in f.values:
        table = _table_holding(f.values, ENVVAR_KEY)
        # An admin appending the line to the file puts it in the last table, where it is not read.
        where = f" (it is under [{table}]: the toolkit reads it at the top level only)" if table else ""
        return HoleState.OPEN, f"{f.path}: {ENVVAR_KEY} is unset (true by default){where}"
    value = f.values[ENVVAR_KEY]
    if value is True:
        return HoleState.OPEN, f"{f.path}: {ENVVAR_KEY} = true"
    if value is False:
        return HoleState.CLOSED, f"{f.path}: {ENVVAR_KEY} = false"
    # The toolkit refuses such a file (a bool field); what the runtime does then is not ours to guess.
    return HoleState.UNKNOWN, f"{f.path}: {ENVVAR_KEY} = {value!r}, not true or false"


def _table_holding(values: dict[str, Any], key: str, prefix: str = "") -> str | None:
    """The dotted name of a (nested) table that has ``key``, if any."""
    for name, value in values.items():
        if isinstance(value, dict):
            dotted = f"{prefix}{name}"
            if key in value:
                return dotted
            found = _table_holding(value, key, dotted + ".")
            if found:
                return found
    return None
