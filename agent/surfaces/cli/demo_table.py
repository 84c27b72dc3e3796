"""The live demo's table: one row per pod, built from the agent's status document
(``surfaces/statusview.py``) and what each workload really got (the simulated GPU's ground
truth)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

BAR_WIDTH = 20


@dataclass(frozen=True)
class PodRow:
    """What the table knows of one pod besides the status document."""

    pod: str
    real_percent: float | None  # GPU time really run over the last refresh; None when it exited
    exited: str  # "" while running, else why it ended (e.g. "killed")


def usage_bar(used: float | None, cap: float | None) -> Text:
    """``████████░░|░░░`` : used in green (red over the cap), the cap as a bar."""
    if used is None:
        return Text("-".ljust(BAR_WIDTH + 1), style="dim")
    filled = min(BAR_WIDTH, round(used / 100 * BAR_WIDTH))
    mark = None if cap is None else min(BAR_WIDTH, round(cap / 100 * BAR_WIDTH))
    over = cap is not None and used > cap + 3
    text = Text()
    for i in range(BAR_WIDTH + 1):
        if i == mark:
            text.append("|", style="bold yellow")
        if i < filled:
            text.append("█", style="red" if over else "green")
        elif i < BAR_WIDTH:
            text.append("░", style="dim")
    return text


def _containers(status: Mapping[str, Any]) -> dict[str, tuple[int, Mapping[str, Any]]]:
    found: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for gpu in status.get("gpus") or []:
        for c in gpu.get("containers") or []:
            found[str(c.get("pod"))] = (int(gpu.get("index", -1)), c)
    return found


def _last_actions(status: Mapping[str, Any]) -> dict[str, str]:
    """Each pod's latest action with its age: ``throttled (3 s ago)``."""
    now = float(status.get("time") or 0)
    last: dict[str, str] = {}
    for action in status.get("recentActions") or []:
        pod = str(action.get("container", "")).split("/")[1:2]
        if pod and not last.get(pod[0], "").startswith("killed"):  # the kill outranks what follows
            age = max(0.0, now - float(action.get("time") or now))
            last[pod[0]] = f"{action.get('action', '')} ({age:.0f} s ago)"
    return last


def _fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def pod_table(title: str, status: Mapping[str, Any], rows: Sequence[PodRow]) -> Table:
    """The table for one refresh. Pods missing from the status (exited) keep a row."""
    table = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for name, justify in (
        ("POD", "left"),
        ("GPU", "right"),
        ("POLICY", "left"),
        ("REQ", "right"),
        ("CAP", "right"),
        ("USE (agent) vs TARGET", "left"),
        ("USE", "right"),
        ("REAL", "right"),
        ("DUTY", "right"),
        ("STATE", "left"),
        ("MEMORY MiB", "right"),
        ("LAST ACTION", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    containers = _containers(status)
    actions = _last_actions(status)
    for row in rows:
        gpu, c = containers.get(row.pod, (-1, {}))
        cap = c.get("capPercent")
        ceiling = c.get("ceilingPercent")
        shown_cap = _fmt(cap, suffix="%") + (f" ≤{ceiling}" if ceiling is not None and ceiling != cap else "")
        goal = c.get("targetPercent", cap)  # what the controller holds it to now (the bar's mark)
        used = c.get("usedPercent")
        held = "frozen" if c.get("frozen") else "throttled" if c.get("throttled") else "running"
        state = row.exited or held
        quota = c.get("memoryQuotaMiB")
        memory = f"{_fmt(c.get('memoryUsedMiB'))} / {_fmt(quota)}" if c else "-"
        table.add_row(
            row.pod,
            "-" if gpu < 0 else str(gpu),
            str(c.get("policy", "-")) + (" (whole)" if c.get("whole") else ""),
            _fmt(c.get("requestCores")),
            shown_cap,
            usage_bar(used, goal),
            _fmt(used, suffix="%"),
            _fmt(row.real_percent, suffix="%"),
            _fmt(c.get("duty"), ".2f"),
            Text(state, style="red" if row.exited else "yellow" if state != "running" else "green"),
            memory,
            actions.get(row.pod, ""),
        )
    return table


def gpu_line(status: Mapping[str, Any]) -> str:
    """``GPU 0 98% used, 100/100 cores allocated | GPU 1 ...``"""
    parts = []
    for gpu in status.get("gpus") or []:
        if (gpu.get("mig") or {}).get("mode") == "enabled":
            devices = len((gpu.get("mig") or {}).get("devices") or [])
            parts.append(f"GPU {gpu.get('index')} MIG mode, {devices} instances, {gpu.get('health', '?')}")
            continue
        parts.append(
            f"GPU {gpu.get('index')} {_fmt(gpu.get('utilizationPercent'), suffix='%')} used, "
            f"{gpu.get('coresAllocated', '-')}/100 cores allocated, {gpu.get('health', '?')}"
        )
    return " | ".join(parts)
