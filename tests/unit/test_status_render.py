"""The status table: alignment, widths from content, whole-GPU dashes, empty GPUs, actions
in local time, and documents that are missing fields or newer than the CLI."""

from __future__ import annotations

import datetime
from typing import Any

from agent.clock import VirtualClock
from agent.settings import ActuatorMode, MemoryQuotaMode
from agent.surfaces.cli.statusrender import (
    CONTAINER_HEADERS,
    actions_block,
    container_row,
    container_table,
    render_status,
    table,
)
from agent.surfaces.statusview import (
    SCHEMA_VERSION,
    ActionLog,
    ContainerStatus,
    GuardExemption,
    action_record,
    agent_info,
    container_status,
    gpu_status,
    status_document,
)


def shared(
    pod: str, cap: float, used: float | None, duty: float, quota: int | None = 1024
) -> ContainerStatus:
    return container_status(
        namespace="default",
        pod=pod,
        container="c",
        policy="fixed-share",
        request_cores=int(cap),
        cap_percent=cap,
        ceiling_percent=cap,
        used_percent=used,
        target_percent=cap,
        duty=duty,
        memory_used_mib=512,
        memory_quota_mib=quota,
    )


def whole(pod: str) -> ContainerStatus:
    # cap/duty given anyway: a whole GPU must still show dashes (the builder nulls them)
    return container_status(
        namespace="ml",
        pod=pod,
        container="main",
        policy="fixed-share",
        request_cores=100,
        whole=True,
        cap_percent=100,
        duty=1.0,
        used_percent=97.0,
        memory_used_mib=40000,
        memory_quota_mib=81559,
    )


def document(actions: int = 1) -> dict[str, Any]:
    agent = agent_info(
        pid=7,
        uptime_s=3725.0,
        backend="simulated",
        enforcing=True,
        actuator=ActuatorMode.FREEZER,
        memory_mode=MemoryQuotaMode.KILL,
        period_s=0.25,
        watchdog="running",
        bpf="ok",
    )
    gpus = [
        gpu_status(
            index=1,
            uuid="GPU-b",
            model="NVIDIA H100 80GB HBM3",
            healthy=False,
            memory_total_mib=81559,
            cores_allocated=0,
        ),
        gpu_status(
            index=0,
            uuid="GPU-a",
            model="NVIDIA H100 80GB HBM3",
            healthy=True,
            memory_total_mib=81559,
            cores_allocated=80,
            utilization_percent=55,
            memory_used_mib=1024,
            containers=[shared("a-much-longer-pod-name", 30, 29.5, 0.31), shared("p", 5, None, 0.02, None)],
        ),
    ]
    recent = [action_record(1763800000.0 + i, "default/p/c", f"action {i}", "") for i in range(actions)]
    return dict(status_document(node="n1", time=1763800000.0, agent=agent, gpus=gpus, recent_actions=recent))


def columns(line: str, starts: list[int]) -> list[str]:
    bounds = [*starts[1:], None]
    return [line[a:b].strip() for a, b in zip(starts, bounds, strict=True)]


def test_table_widths_come_from_content_and_numbers_align_right() -> None:
    lines = table(("NAME", "N", "X"), [["a", "5", "left"], ["long-name", "100", "l"]], "<><")
    assert lines == [
        "NAME" + " " * 9 + "N  X",
        "a" + " " * 12 + "5  left",
        "long-name  100  l",  # the last column's padding is stripped
    ]


def test_a_throttled_container_shows_its_gpus_duty_cycle() -> None:
    throttled = {**shared("p", 30, 31.0, 0.4), "cycleSeconds": 2.0, "throttled": True}
    assert container_row(throttled)[6:8] == ["0.40", "2.00"]
    assert container_row(shared("q", 30, 10.0, 1.0))[7] == "-"  # not throttled: no cycle


def test_container_columns_line_up_under_their_headers() -> None:
    doc = document()
    lines = container_table(doc["gpus"][0]["containers"])
    header = lines[0]
    starts = [header.index(h) for h in CONTAINER_HEADERS]
    assert starts == sorted(starts)
    # every left-aligned column starts where its header starts
    for line in lines[1:]:
        assert line[starts[1] - 2 : starts[1]] == "  "
        assert line[starts[1] :].startswith("fixed-share")
    # right-aligned columns end where their header ends
    req_end = header.index("REQ") + len("REQ")
    assert [line[req_end - 2 : req_end] for line in lines[1:]] == ["30", " 5"]
    assert lines[1].startswith("default/a-much-longer-pod-name/c  ")
    assert lines[2].startswith("default/p/c" + " " * (len("default/a-much-longer-pod-name/c") - 11) + "  ")
    assert lines[2].split()[5] == "-"  # no sample yet: USED% unknown
    assert lines[2].split()[-2] == "512/-"  # no vcuda-memory quota
    assert lines[2].split()[-1] == "freezer/kill"  # what holds its compute share and its memory


def test_whole_gpu_containers_show_dashes_for_cap_target_and_duty() -> None:
    row = container_row(whole("trainer"))
    assert row[:10] == [
        "ml/trainer/main",
        "fixed-share",
        "100",
        "-",
        "-",
        "97%",
        "-",
        "-",
        "no",
        "40000/81559",
    ]
    # the renderer does not trust the producer either
    raw: dict[str, Any] = {**whole("x"), "capPercent": 100, "duty": 1.0, "targetPercent": 100}
    assert container_row(raw)[3:7] == ["-", "-", "97%", "-"]


def test_gpus_in_index_order_and_an_empty_gpu_says_no_containers() -> None:
    text = render_status(document())
    lines = text.splitlines()
    assert lines[0] == (
        "node n1  backend simulated  enforcement on  actuator freezer  memory kill  watchdog running  bpf ok"
    )
    assert lines[1].startswith("agent pid 7, up 1h02m, period 0.25 s; as of ")
    gpu0 = lines.index(next(line for line in lines if line.startswith("GPU 0 ")))
    gpu1 = lines.index(next(line for line in lines if line.startswith("GPU 1 ")))
    assert gpu0 < gpu1
    assert "Healthy  util 55%  memory 1024/81559 MiB  cores allocated 80/100" in lines[gpu0]
    assert "Unhealthy  util -  memory -/81559 MiB" in lines[gpu1]
    assert lines[gpu1 + 1] == "  no containers"
    assert "note:" not in text


def test_last_ten_actions_in_local_time() -> None:
    doc = document(actions=15)
    lines = actions_block(doc["recentActions"])
    assert lines[0] == "recent actions (last 10 of 15):"
    assert len(lines) == 12  # title, header, 10 rows
    assert "action 4" not in "\n".join(lines)
    first = datetime.datetime.fromtimestamp(1763800005.0).strftime("%Y-%m-%d %H:%M:%S")
    assert lines[2].startswith(f"  {first}  default/p/c  action 5")
    node_wide = actions_block([action_record(1763800000.0, "", "watchdog restarted")])
    assert node_wide[2].split()[2:] == ["-", "watchdog", "restarted"]
    assert actions_block([]) == ["no recent actions"]


def test_partial_newer_and_garbage_documents_render_without_errors() -> None:
    text = render_status({"version": 2, "node": "n9", "gpus": [{"index": 0, "containers": [{"pod": "p"}]}]})
    assert "note: status schema version 2; this CLI knows version 1" in text
    assert "-/p/-" in text
    assert "no recent actions" in text
    junk = render_status({"gpus": "nope", "agent": [], "recentActions": [3, None], "time": "later"})
    assert "no GPUs" in junk
    assert "as of -" in junk
    nan_and_bools = container_row({"usedPercent": float("nan"), "requestCores": True, "frozen": "maybe"})
    assert nan_and_bools[2] == "-"
    assert nan_and_bools[5] == "-"
    assert nan_and_bools[7] == "-"


def test_builders_stamp_the_version_and_sort_gpus() -> None:
    doc = document()
    assert doc["version"] == SCHEMA_VERSION == 1
    assert [g["index"] for g in doc["gpus"]] == [0, 1]
    assert doc["agent"]["actuator"] == "freezer"
    assert doc["agent"]["enforcement"] == "on"
    assert doc["gpus"][1]["health"] == "Unhealthy"
    w = whole("t")
    assert (w["capPercent"], w["ceilingPercent"], w["targetPercent"], w["duty"]) == (None, None, None, None)


def test_action_log_keeps_the_newest_entries() -> None:
    clock = VirtualClock(start=100.0)
    log = ActionLog(limit=3, clock=clock)
    for i in range(5):
        log.record("default/p/c", f"froze {i}")
        clock.advance(1.0)
    snap = log.snapshot()
    assert [a["action"] for a in snap] == ["froze 2", "froze 3", "froze 4"]
    assert [a["time"] for a in snap] == [102.0, 103.0, 104.0]
    snap[0]["action"] = "changed"
    assert log.snapshot()[0]["action"] == "froze 2"  # copies: the log cannot be edited from outside


def test_a_gpu_shared_through_mps_shows_its_daemon_and_what_holds_each_container() -> None:
    doc = document()
    gpu = doc["gpus"][0]
    gpu["sharing"], gpu["sharingReason"] = "mps", "control daemon running"
    gpu["mpsDaemon"] = {"state": "running", "pid": 4242, "restarts": 1, "error": "exited with -9"}
    gpu["containers"][0]["computeHeldBy"], gpu["containers"][0]["memoryHeldBy"] = "mps+freezer", "driver"
    text = render_status(doc)
    assert "sharing mps (daemon running, pid 4242, 1 restarts, last: exited with -9)" in text
    assert "mps+freezer/driver" in text
    older = document()  # an agent from before MPS mode: no sharing fields at all
    for g in older["gpus"]:
        g.pop("sharing", None)
    assert "sharing" not in render_status(older).splitlines()[2]


def test_a_degraded_gpu_and_an_unwritable_journal_are_shown_and_absent_otherwise() -> None:
    doc = document()
    assert "DEGRADED" not in render_status(doc) and "freeze journal" not in render_status(doc)
    doc["gpus"][0]["degraded"] = "nvmlDeviceGetProcessUtilization did not return within 2 s"
    doc["agent"]["freezeJournal"] = "cannot write the freeze journal /run/x/frozen.json: [Errno 28] No space"
    text = render_status(doc)
    assert "DEGRADED (nvmlDeviceGetProcessUtilization did not return within 2 s)" in text
    assert "freeze journal: cannot write the freeze journal /run/x/frozen.json" in text


def test_the_dra_driver_state_is_shown_only_under_dra() -> None:
    doc = document()
    assert "DRA driver" not in render_status(doc)
    doc["agent"]["dra"] = "off"
    assert "DRA driver" not in render_status(doc)
    doc["agent"]["dra"] = "registered; prepared claims: 2; slice generation 3, devices: 1"
    assert "DRA driver gpu.vcuda.io: registered; prepared claims: 2" in render_status(doc)


def test_a_cap_the_freezer_cannot_hold_gets_a_line_under_its_gpu() -> None:
    doc = document()
    held = container_status(
        namespace="ml",
        pod="deep-queue",
        container="main",
        policy="fixed-share",
        request_cores=30,
        cap_percent=30,
        throttled=True,
        unholdable="at least 8.0 s of GPU work runs on after every freeze",
    )
    doc["gpus"][1]["containers"].append(held)
    lines = render_status(doc).splitlines()
    (note,) = [line for line in lines if "cap not holdable" in line]
    assert (
        note.strip()
        == "ml/deep-queue/main: cap not holdable: at least 8.0 s of GPU work runs on after every freeze"
    )
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("ml/deep-queue/main "))
    assert lines.index(note) > row
    assert "cap not holdable" not in render_status(document())


def test_guard_exemptions_are_listed_with_their_reason() -> None:
    doc = document()
    assert doc["guardExemptions"] == [] and "device guard exemptions" not in render_status(doc)
    doc["guardExemptions"] = [
        GuardExemption(namespace="team-a", pod="trainer", reason="nvidia.com/gpu: 1 (container main) ...")
    ]
    text = render_status(doc).splitlines()
    at = text.index("device guard exemptions")
    assert text[at + 1] == "  team-a/trainer: nvidia.com/gpu: 1 (container main) ..."
