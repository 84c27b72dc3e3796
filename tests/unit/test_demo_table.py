"""The live demo's table, rendered from a status document."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from agent.surfaces.cli.demo_table import PodRow, gpu_line, pod_table, usage_bar


def _status() -> dict[str, Any]:
    container = {"namespace": "default", "container": "c", "requestCores": 40, "whole": False}
    return {
        "time": 100.0,
        "gpus": [
            {
                "index": 1,
                "utilizationPercent": 73,
                "coresAllocated": 90,
                "health": "Healthy",
                "containers": [
                    container
                    | {"pod": "burst", "policy": "burst-share", "capPercent": 40, "ceilingPercent": 100}
                    | {"targetPercent": 40, "usedPercent": 41.0, "duty": 0.5, "frozen": True}
                    | {"throttled": True, "memoryUsedMiB": 900, "memoryQuotaMiB": 1024},
                    container
                    | {"pod": "leaky", "policy": "fixed-share", "capPercent": 10, "ceilingPercent": 10}
                    | {"targetPercent": 10, "usedPercent": None, "duty": 1.0, "frozen": False}
                    | {"throttled": False, "memoryUsedMiB": 0, "memoryQuotaMiB": 1024},
                ],
            }
        ],
        "recentActions": [
            {"time": 90.0, "container": "default/leaky/c", "action": "killed pid 7", "detail": "over"},
            {"time": 95.0, "container": "default/leaky/c", "action": "released", "detail": ""},
            {"time": 97.0, "container": "default/burst/c", "action": "throttled", "detail": ""},
        ],
    }


def _text(status: dict[str, Any], rows: list[PodRow]) -> str:
    console = Console(record=True, width=220)
    console.print(pod_table("t", status, rows))
    return console.export_text()


def test_each_pod_gets_its_row_with_cap_ceiling_memory_and_last_action() -> None:
    text = _text(
        _status(), [PodRow("burst", 39.5, ""), PodRow("leaky", None, "killed"), PodRow("gone", None, "")]
    )
    burst = next(line for line in text.splitlines() if "burst" in line)
    assert "burst-share" in burst and "40% ≤100" in burst and "41%" in burst and "40%" in burst
    assert "frozen" in burst and "900 / 1024" in burst and "throttled (3 s ago)" in burst
    leaky = next(line for line in text.splitlines() if "leaky" in line)
    assert "killed pid 7 (10 s ago)" in leaky  # a later "released" does not hide the kill
    assert "killed" in leaky.split("│")[10]
    gone = next(line for line in text.splitlines() if "gone" in line)
    assert gone.count("-") >= 5  # a pod the status does not know keeps a row of dashes


def test_the_bar_marks_the_target_and_turns_red_over_it() -> None:
    bar = usage_bar(60.0, 40.0)
    assert bar.plain.index("|") == 8 and bar.plain.count("█") == 12
    assert any(span.style == "red" for span in bar.spans)
    assert not any(span.style == "red" for span in usage_bar(41.0, 40.0).spans)


def test_gpu_line() -> None:
    assert gpu_line(_status()) == "GPU 1 73% used, 90/100 cores allocated, Healthy"
