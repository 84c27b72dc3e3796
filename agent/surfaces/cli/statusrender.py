"""Text rendering of the status document (schema: ``surfaces/statusview.py``).

The document comes from another process, maybe another version of the agent: every
field is read defensively, and anything missing or of the wrong type shows as ``-``.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

from agent.surfaces.statusview import SCHEMA_VERSION

MAX_ACTIONS = 10
DASH = "-"
CONTAINER_HEADERS = (
    "NAMESPACE/POD/CONTAINER",
    "POLICY",
    "REQ",
    "CAP",
    "TARGET",
    "USED%",
    "DUTY",
    "CYCLE s",
    "FROZEN",
    "MEM USED/QUOTA MiB",
    "HELD BY",
)
# Numbers right-aligned so their digits line up; names left-aligned.
CONTAINER_ALIGN = "<<>>>>>><><"
ACTION_HEADERS = ("TIME", "CONTAINER", "ACTION", "DETAIL")


def render_status(doc: Mapping[str, Any], max_actions: int = MAX_ACTIONS) -> str:
    """The whole status as text: header, one block per GPU, the last ``max_actions`` actions."""
    lines = _header(doc)
    gpus = _mappings(doc.get("gpus"))
    if not gpus:
        lines += ["", "no GPUs"]
    for gpu in gpus:
        lines += ["", gpu_line(gpu)]
        lines += ["  " + row for row in mig_lines(gpu)]
        containers = _mappings(gpu.get("containers"))
        lines += ["  " + row for row in container_table(containers)]
        lines += ["  " + row for row in unholdable_notes(containers)]
    lines += exemption_lines(_mappings(doc.get("guardExemptions")))
    lines += ["", *actions_block(_mappings(doc.get("recentActions")), max_actions)]
    return "\n".join(lines)


def exemption_lines(exemptions: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pods the device guard leaves alone and why; nothing when there are none."""
    if not exemptions:
        return []
    rows = [
        f"  {_text(e.get('namespace'))}/{_text(e.get('pod'))}: {_text(e.get('reason'))}" for e in exemptions
    ]
    return ["", "device guard exemptions", *rows]


def _header(doc: Mapping[str, Any]) -> list[str]:
    agent = _mapping(doc.get("agent"))
    fields = (
        ("node", doc.get("node")),
        ("backend", agent.get("backend")),
        ("enforcement", agent.get("enforcement")),
        ("actuator", agent.get("actuator")),
        ("memory", agent.get("memoryMode")),
        ("watchdog", agent.get("watchdog")),
        ("bpf", agent.get("bpf")),
    )
    lines = ["  ".join(f"{name} {_text(value)}" for name, value in fields)]
    lines.append(
        f"agent pid {_text(agent.get('pid'))}, up {duration(agent.get('uptimeSeconds'))}, "
        f"period {_number(agent.get('periodSeconds'), 2)} s; as of {local_time(doc.get('time'))}"
    )
    journal = agent.get("freezeJournal")
    if isinstance(journal, str) and journal != "ok":
        lines.append(f"freeze journal: {journal} (containers it does not list yet are not frozen)")
    hole = _mapping(agent.get("visibleDevicesHole"))
    if hole.get("state") in ("open", "unknown"):
        lines.append(f"NVIDIA_VISIBLE_DEVICES hole {_text(hole.get('state'))}: {_text(hole.get('detail'))}")
    dra = agent.get("dra")
    if isinstance(dra, str) and dra != "off":
        lines.append(f"DRA driver gpu.vcuda.io: {dra}")
    version = doc.get("version")
    if version != SCHEMA_VERSION:
        lines.append(
            f"note: status schema version {_text(version)}; this CLI knows version {SCHEMA_VERSION} "
            "and shows what it understands"
        )
    return lines


def gpu_line(gpu: Mapping[str, Any]) -> str:
    util = _percent(gpu.get("utilizationPercent"))
    memory = f"{_number(gpu.get('memoryUsedMiB'))}/{_number(gpu.get('memoryTotalMiB'))} MiB"
    return (
        f"GPU {_text(gpu.get('index'))}  {_text(gpu.get('model'))}  {_text(gpu.get('uuid'))}  "
        f"{_text(gpu.get('health'))}  util {util}  memory {memory}  "
        f"cores allocated {_number(gpu.get('coresAllocated'))}/100{_sharing(gpu)}{_degraded(gpu)}"
    )


def mig_lines(gpu: Mapping[str, Any]) -> list[str]:
    """``MIG enabled`` (with a pending change) and one line per MIG device; nothing for a GPU
    without MIG or from an older agent."""
    mig = _mapping(gpu.get("mig"))
    if not mig:
        return []
    mode, pending = _text(mig.get("mode")), _text(mig.get("pending"))
    head = f"MIG {mode}" + (f" ({pending} after a GPU reset)" if pending != mode else "")
    if mig.get("strategy"):
        head += f", strategy {_text(mig.get('strategy'))}"
    rows = [head]
    if mig.get("shares"):
        rows.append(f"  no shares: {_text(mig.get('shares'))}")
    geometry = _mapping(mig.get("geometry"))
    if geometry:
        rows.append(f"  geometry {_text(geometry.get('state'))}: {_text(geometry.get('reason'))}")
    for d in _mappings(mig.get("devices")):
        health = _text(d.get("health"))
        if d.get("healthReason"):
            health += f" ({_text(d.get('healthReason'))})"
        rows.append(
            f"  {_text(d.get('profile'))}  GI {_text(d.get('gi'))} CI {_text(d.get('ci'))}  "
            f"at {_text(d.get('placement'))}  {_number(d.get('memoryMiB'))} MiB  "
            f"{_text(d.get('uuid'))}  {health}"
        )
    return rows


def _degraded(gpu: Mapping[str, Any]) -> str:
    """``  DEGRADED (why)`` while the agent cannot read the GPU; nothing otherwise."""
    reason = gpu.get("degraded")
    return f"  DEGRADED ({reason})" if isinstance(reason, str) and reason else ""


def _sharing(gpu: Mapping[str, Any]) -> str:
    """``  sharing mps (daemon running, pid 7, 0 restarts)``; nothing from an older agent."""
    sharing = gpu.get("sharing")
    if sharing is None:
        return ""
    daemon = gpu.get("mpsDaemon")
    if isinstance(daemon, Mapping):
        state = f"daemon {_text(daemon.get('state'))}, pid {_text(daemon.get('pid'))}, "
        state += f"{_number(daemon.get('restarts'))} restarts"
        if daemon.get("error"):
            state += f", last: {_text(daemon.get('error'))}"
    else:
        state = _text(gpu.get("sharingReason"))
    return f"  sharing {_text(sharing)} ({state})"


def container_row(c: Mapping[str, Any]) -> list[str]:
    whole = c.get("whole") is True  # a whole GPU is never capped: no cap, target or duty
    name = "/".join(_text(c.get(k)) for k in ("namespace", "pod", "container"))
    return [
        name,
        _text(c.get("policy")),
        _number(c.get("requestCores")),
        DASH if whole else _percent(c.get("capPercent")),
        DASH if whole else _percent(c.get("targetPercent")),
        _percent(c.get("usedPercent")),
        DASH if whole else _number(c.get("duty"), 2, fixed=True),
        DASH if c.get("cycleSeconds") is None else _number(c.get("cycleSeconds"), 2, fixed=True),
        _yes_no(c.get("frozen")),
        f"{_number(c.get('memoryUsedMiB'))}/{_number(c.get('memoryQuotaMiB'))}",
        f"{_text(c.get('computeHeldBy'))}/{_text(c.get('memoryHeldBy'))}",
    ]


def container_table(containers: Sequence[Mapping[str, Any]]) -> list[str]:
    if not containers:
        return ["no containers"]
    return table(CONTAINER_HEADERS, [container_row(c) for c in containers], CONTAINER_ALIGN)


def unholdable_notes(containers: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per container whose cap the freezer cannot hold, and why."""
    return [
        f"{'/'.join(_text(c.get(k)) for k in ('namespace', 'pod', 'container'))}: "
        f"cap not holdable: {_text(c.get('unholdable'))}"
        for c in containers
        if isinstance(c.get("unholdable"), str) and c.get("unholdable")
    ]


def actions_block(actions: Sequence[Mapping[str, Any]], limit: int = MAX_ACTIONS) -> list[str]:
    if not actions:
        return ["no recent actions"]
    shown = list(actions)[-limit:] if limit > 0 else []
    more = len(actions) - len(shown)
    title = f"recent actions (last {len(shown)} of {len(actions)})" if more else "recent actions"
    rows = [
        [
            local_time(a.get("time")),
            _text(a.get("container") or None),
            _text(a.get("action")),
            _text(a.get("detail"), empty=""),
        ]
        for a in shown
    ]
    return [title + ":", *("  " + row for row in table(ACTION_HEADERS, rows, "<<<<"))]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Columns as wide as their widest cell; ``align`` has one ``<`` or ``>`` per column.
    Trailing spaces are stripped so the last column does not pad the line."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    out = []
    for row in (headers, *rows):
        cells = [
            str(cell).rjust(width) if how == ">" else str(cell).ljust(width)
            for cell, width, how in zip(row, widths, align, strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return out


def local_time(value: Any) -> str:
    """Unix seconds as this machine's local date and time."""
    if not _is_number(value):
        return DASH
    try:
        return datetime.datetime.fromtimestamp(float(value)).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return DASH


def duration(value: Any) -> str:
    if not _is_number(value) or value < 0:
        return DASH
    seconds = int(value)
    if seconds < 60:
        return f"{float(value):.1f}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _number(value: Any, decimals: int = 1, fixed: bool = False) -> str:
    """Integers as integers; other numbers with ``decimals`` places (always, if ``fixed``)."""
    if not _is_number(value):
        return DASH
    if not fixed and float(value).is_integer():
        return str(int(value))
    return f"{float(value):.{decimals}f}"


def _percent(value: Any) -> str:
    text = _number(value)
    return text if text == DASH else text + "%"


def _yes_no(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else DASH


def _text(value: Any, empty: str = DASH) -> str:
    if value is None or value == "":
        return empty
    return str(value)


def _is_number(value: Any) -> bool:
    # bool is an int to Python, but true/false is not a number in this document
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
