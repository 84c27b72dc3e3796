"""bench/gpu_suite.py, the GPU script, where there is no GPU: its stop without an NVIDIA driver
(the path this machine takes), the whole script on the simulated GPU (--simulate --quick),
its budget, the NVML reading against the in-memory fake, the workers' progress files
(``sim-workload --progress``, and the PyTorch programs on the CPU where PyTorch is
installed: CI only compiles them).

What still needs a lent GPU: the real driver's answers, CUDA workers, the freeze latency of a
process inside a driver call, and the enforcement stage against real NVML.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import py_compile
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

from gpu_budget import Budget, Summary, attempt  # noqa: E402
from gpu_inventory import nvml_inventory, v2_root  # noqa: E402
from gpu_recording import OVERLAP_US, Slot, next_edge, thawed_at  # noqa: E402
from gpu_sources import NvmlSource  # noqa: E402
from gpu_traces import PatternRecording, TraceSetup, run_traces, segments  # noqa: E402

from agent.platform.gpu.sim.backend import SimulatedBackend  # noqa: E402
from tests.fakes.fake_nvml import FakeGpu, FakeNvml  # noqa: E402

SUITE = BENCH / "gpu_suite.py"
META_KEYS = ("t", "pattern", "gpu", "driver", "workers", "alone_steps_per_s", "sample_calls_s", "schema")
KEYS = {
    "meta": {*META_KEYS, "simulated"},
    "segment": {"t", "name", "start", "end", "plan"},
    "act": {"t", "w", "who", "op", "frozen_w"},
    "proc": {"t", "w", "since", "samples"},
    "dev": {"t", "w", "since", "samples"},
    "util": {"t", "w", "gpu", "mem"},
    "steps": {"t", "who", "w"},
    "end": {"t", "w"},
}  # fmt: skip
NO_DRIVER_HERE = not Path("/dev/nvidiactl").exists() and not Path("/proc/driver/nvidia").exists()


def _torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def cgroup_v2_writable() -> str | None:
    """Why the traces cannot freeze here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (cgroup.freeze)"
    if v2_root() is None:
        return "no cgroup v2 hierarchy (pure or hybrid)"
    return None


def run_suite(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )


def steps_in(records: list[dict[str, Any]], who: str, seg: dict[str, Any]) -> int:
    return sum(
        1
        for r in records
        if r["t"] == "steps" and r["who"] == who
        for t in r["w"]
        if seg["start"] < t <= seg["end"]
    )


def read_trace(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.skipif(
    not NO_DRIVER_HERE, reason="this machine has an NVIDIA driver: the no-driver stop cannot happen"
)
def test_without_a_driver_it_stops_clearly_with_the_inventory(tmp_path: Path) -> None:
    done = run_suite("--out", str(tmp_path / "out"))
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.search(
        r"^gpu_suite: no NVIDIA driver \(.+\): nothing to measure here; inventory written to ",
        done.stdout,
        re.M,
    )
    assert lines[-1] == "RESULT nvidia=absent"
    inventory = json.loads((tmp_path / "out" / "inventory.json").read_text())
    assert inventory["nvidia"].startswith("no NVIDIA driver: ")
    host = inventory["host"]
    assert host["cgroup"]["version"] in ("v2", "hybrid", "v1", "none")
    assert set(host["bpf"]) >= {"raw_load", "tracer", "bcc"}
    assert host["python"]["version"] and "torch" in host
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["inventory.json", "summary.json"]


def test_the_mps_probe_is_skipped_with_a_reason_on_the_simulated_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_suite("--simulate", "--quick", "--only", "inventory,mps", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["part"] for s in summary["skipped"]] == ["mps"], summary["skipped"]
    assert "real daemon" in summary["skipped"][0]["why"]


@pytest.mark.privileged
@pytest.mark.slow
def test_simulated_quick_run_records_traces_in_the_schema(tmp_path: Path) -> None:
    why = cgroup_v2_writable()
    if why:
        pytest.skip(why)
    out = tmp_path / "out"
    parents_before = set(v2_root().glob("vcuda-gpu-suite-*"))  # type: ignore[union-attr]
    done = run_suite(
        "--simulate", "--quick", "--only", "inventory,traces", "--patterns", "train,graph", "--out", str(out)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^RESULT nvidia=simulated .*traces=2 .*errors=0 ", done.stdout, re.M), done.stdout[
        -500:
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and not summary["errors"] and not summary["skipped"]
    for pattern in ("train", "graph"):
        path = out / "traces" / f"trace-{pattern}.jsonl.gz"
        assert str(path) in summary["files"]
        records = read_trace(path)
        assert records[0]["t"] == "meta" and records[-1]["t"] == "end"
        assert {r["t"] for r in records} == set(KEYS)
        for r in records:
            assert set(r) == KEYS[r["t"]], r
        meta = records[0]
        assert meta["pattern"] == pattern and meta["simulated"] and meta["schema"] == 1
        assert meta["alone_steps_per_s"] and meta["alone_steps_per_s"] > 0
        for pid in meta["workers"].values():  # killed, and their cgroups gone
            assert not Path(f"/proc/{pid}").exists()
        freezes = [r for r in records if r["t"] == "act" and r["op"] == "freeze"]
        assert freezes and all(r["frozen_w"] is not None and r["frozen_w"] >= r["w"] for r in freezes), (
            freezes
        )
        overlapping = [
            r for r in records if r["t"] == "proc" and r["since"] == round(r["w"] * 1e6) - OVERLAP_US
        ]
        assert overlapping and any(r["samples"] for r in records if r["t"] == "proc")
        segs = {r["name"]: r for r in records if r["t"] == "segment"}
        assert list(segs) == [s.name for s in segments(quick=True)]
        alone = steps_in(records, "A", segs["A alone"])
        held = [steps_in(records, "A", s) for name, s in segs.items() if name.startswith("A duty 0.3")]
        assert alone > max(held), (alone, held)
    assert set(v2_root().glob("vcuda-gpu-suite-*")) <= parents_before  # type: ignore[union-attr]


def test_a_part_that_would_overrun_the_budget_is_skipped_and_listed(tmp_path: Path) -> None:
    now = [0.0]
    budget = Budget(100.0, reserve_s=10.0, clock=lambda: now[0])
    summary = Summary(tmp_path / "summary.json", {})
    ran: list[str] = []
    now[0] = 50.0
    assert attempt("fits", 40.0, budget, summary, lambda: ran.append("fits")) is None  # 40 <= 100 - 10 - 50
    assert attempt("too long", 41.0, budget, summary, lambda: ran.append("too long")) is None
    assert attempt("fails", 1.0, budget, summary, lambda: 1 / 0) is None
    assert ran == ["fits"]
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert [s["part"] for s in doc["skipped"]] == ["too long"]
    assert "needs about 41 s, 40 s of the budget left" in doc["skipped"][0]["why"]
    assert [e["part"] for e in doc["errors"]] == ["fails"] and "ZeroDivisionError" in doc["errors"][0][
        "error"
    ]


def test_traces_that_do_not_fit_start_nothing_and_are_listed(tmp_path: Path) -> None:
    class Absent:
        simulated = False  # real start-up estimates: more than this budget has

    summary = Summary(tmp_path / "summary.json", {})
    setup = TraceSetup(Absent(), tmp_path, tmp_path, None, sys.executable, {})  # type: ignore[arg-type]
    assert run_traces(setup, ["train", "graph"], Budget(40.0, reserve_s=5.0), summary, keep_s=0.0) == 0
    assert [s["part"] for s in summary.doc["skipped"]] == ["traces/train", "traces/graph"]
    assert not list(tmp_path.glob("**/*.jsonl*")) and not setup.outcomes


def test_schedules_thaw_and_freeze_at_their_edges() -> None:
    slot = Slot(0.6, 1.0, 0.4)  # thawed [0.4, 1.0) of each second
    assert [thawed_at(slot, t) for t in (0.0, 0.39, 0.4, 0.99, 1.0, 1.5)] == [
        False,
        False,
        True,
        True,
        False,
        True,
    ]
    assert next_edge(slot, 0.0) == pytest.approx(0.4) and next_edge(slot, 0.5) == pytest.approx(1.0)
    assert thawed_at("free", 3.0) and not thawed_at("frozen", 3.0) and next_edge("free", 1.0) == float("inf")
    quick = segments(quick=True)
    assert len(quick) == 9 and {s.seconds for s in quick} == {1.0}
    assert sum(s.seconds for s in segments()) == pytest.approx(38.0)


def fake_nvml() -> FakeNvml:
    nvml = FakeNvml(
        [FakeGpu(uuid="GPU-11111111-2222-3333-4444-555555555555", bus_id="00000000:3B:00.0", minor=0)]
    )
    nvml.nvmlInit()  # as open_nvml leaves it
    now = int(time.time() * 1e6)
    nvml.set_process_samples(0, [(4242, now - 300_000, 57, 12), (4243, now - 100_000, 31, 5)])
    nvml.set_utilization_samples(0, [now - 300_000, now - 133_000], [80, 90])
    return nvml


def test_nvml_is_read_raw_and_what_the_binding_lacks_is_a_fact() -> None:
    nvml = fake_nvml()
    source = NvmlSource(nvml)
    assert (
        source.gpu_uuid.startswith("GPU-11111111") and source.driver
    )  # "unknown (...)" if the fake has none
    got = source.proc(0)
    assert got == [[4242, got[0][1], 57, 12], [4243, got[1][1], 31, 5]]
    assert source.proc(got[1][1]) == []  # NOT_FOUND: nothing newer
    dev = source.dev(0)
    assert [v for _t, v in dev] == [80, 90] and source.dev(dev[-1][0]) == []
    assert source.util()[0] >= 0
    facts = nvml_inventory(nvml)
    calls = facts["calls_gpu0"]
    assert calls["nvmlDeviceGetProcessUtilization"]["since_0"][0][:1] == [4242]
    assert (
        calls["nvmlDeviceGetSamples"]["count"] == 2
        and calls["nvmlDeviceGetSamples"]["median_gap_us"] == 167_000
    )
    assert "nvmlGpmQueryDeviceSupport" in calls  # an answer or "error: ...": the fake binding has no GPM
    assert facts["symbols"]["nvmlDeviceSetMemoryLimits_v1"]["library"] == "present"
    assert facts["memory_limits"] == "supported"


@pytest.fixture
def sim_node(short_dir: Path) -> Iterator[SimulatedBackend]:
    backend = SimulatedBackend("1xH100-80GB", "test-node", short_dir / "sim")
    yield backend
    backend.close()


@pytest.mark.parametrize("pattern", ["train", "burn"])
def test_sim_workload_appends_each_steps_completion_time(
    sim_node: SimulatedBackend, tmp_path: Path, pattern: str
) -> None:
    progress = tmp_path / f"{pattern}.steps"
    started = time.time()
    workload = [sys.executable, "-m", "agent", "sim-workload", "--sim-state-dir", str(sim_node.root.root)]
    workload += ["--gpu", "0", "--pattern", pattern, "--kernels", "1", "--kernel-ms", "5", "--duration", "1"]
    done = subprocess.run(
        [*workload, "--progress", str(progress)], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    stamps = [float(line) for line in progress.read_text().splitlines()]
    assert stamps == sorted(stamps) and started < stamps[0] and stamps[-1] < time.time()
    # train: a step per 5 ms sync; burn (no sync): a mark per batch of 64 launches queued, the
    # first 16 at once (1024 launches fill the queue), then one per 64 kernels (0.32 s) completed.
    assert 100 < len(stamps) < 220 if pattern == "train" else 16 <= len(stamps) <= 22, len(stamps)


def test_the_pytorch_workloads_compile() -> None:
    py_compile.compile(str(BENCH / "gpu_workloads.py"), doraise=True)


@pytest.mark.skipif(
    not _torch(), reason="PyTorch is not installed here (the GPU machine has it; CI only compiles)"
)
@pytest.mark.parametrize("pattern", ["train", "infer", "burn", "graph"])
def test_the_pytorch_workloads_run_on_the_cpu(tmp_path: Path, pattern: str) -> None:
    progress = tmp_path / "steps"
    cmd = [sys.executable, str(BENCH / "gpu_workloads.py"), pattern, str(progress), "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "steps.ready").read_text().strip().isdigit()
    assert len(progress.read_text().splitlines()) >= 1


@pytest.mark.skipif(not _torch(), reason="PyTorch is not installed here (the GPU machine has it)")
def test_the_real_path_with_cpu_workers_and_fake_nvml(tmp_path: Path) -> None:
    """Everything the GPU run does but CUDA and the driver: gpu_workloads.py workers in their
    cgroups, their ready and go files, the freezer, NVML read through the binding's shapes."""
    why = cgroup_v2_writable()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    source = NvmlSource(fake_nvml())
    setup = TraceSetup(source, tmp_path / "out", tmp_path, v2_root(), sys.executable, env, quick=True)
    setup.worker_args = ("--device", "cpu")
    segs = segments(quick=True)[:2]
    path = PatternRecording(setup, "train", segs, 0.2, Budget(120), until_s=100).run()
    records = read_trace(path)
    meta = records[0]
    assert meta["simulated"] is False and meta["alone_steps_per_s"] > 0
    assert {r["t"] for r in records} == set(KEYS)
    assert any(r["samples"] for r in records if r["t"] == "proc")  # the fake's samples, as raw entries
    steps_b = [t for r in records if r["t"] == "steps" and r["who"] == "B" for t in r["w"]]
    last_end = max(r["end"] for r in records if r["t"] == "segment")
    assert all(
        t > last_end for t in steps_b
    )  # B was frozen from before its go file to the last segment's end
    assert setup.outcomes["train"]["freezer"] == "cgroup.freeze" and not setup.outcomes["train"]["errors"]
