"""`vcuda-agent run` as a process: signals, config errors, metrics and probes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.emulators.kubelet import KubeletEmulator
from tests.conftest import AgentProcess
from tests.integration.image_run import http_get

Start = Callable[..., AgentProcess]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(start_agent: Start, kubelet: KubeletEmulator, signum: int) -> None:
    agent = start_agent()
    kubelet.wait_for_plugin()
    assert (agent.sim_dir / "node.json").exists()
    assert agent.stop(signum) == 0
    assert not (agent.plugin_dir / "vcuda-core.sock").exists()
    assert not (agent.sim_dir / "node.json").exists()
    assert "stopped" in agent.log()


def test_metrics_and_probes(start_agent: Start, short_dir: Path) -> None:
    agent = start_agent()
    port = agent.metrics_port()
    assert http_get(port, "/healthz") == (200, "ok\n")
    code, body = http_get(port, "/readyz")
    assert code == 503 and "not registered" in body
    emulator = KubeletEmulator(short_dir / "dp")
    emulator.start()
    try:
        emulator.wait_for_plugin()
        code, body = http_get(port, "/readyz")
        assert code == 200 and "2 GPUs" in body
        code, metrics = http_get(port, "/metrics")
        assert code == 200
        assert 'vcuda_gpu_healthy{gpu="0"' in metrics
        assert 'vcuda_kubelet_registered{node="test-node"} 1.0' in metrics
        assert "vcuda_build_info{" in metrics
        assert http_get(port, "/nope")[0] == 404
    finally:
        emulator.stop()


def run_agent(short_dir: Path, *args: str, spec: str = "1xT4-16GB") -> subprocess.CompletedProcess[str]:
    """`vcuda-agent run --no-kube --simulate SPEC` with its dirs under ``short_dir``, plus ``args``."""
    dirs = ("--sim-state-dir", str(short_dir / "sim"), "--device-plugin-dir", str(short_dir / "dp"))
    return run_cli("run", "--no-kube", "--simulate", spec, *dirs, *args)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=60)


def test_invalid_config_exits_non_zero_naming_each_field(short_dir: Path) -> None:
    config = short_dir / "config.json"
    config.write_text(
        json.dumps(
            {
                "nodeConfig": [
                    {"name": "gpu-a", "deviceMemoryScaling": 2},
                    {"name": "gpu-b", "cgroupDriver": "docker"},
                ]
            }
        )
    )
    result = run_agent(short_dir, "--config", str(config))
    assert result.returncode == 2
    assert "node 'gpu-a'" in result.stderr and "deviceMemoryScaling" in result.stderr
    assert "node 'gpu-b'" in result.stderr and "cgroupDriver" in result.stderr


def test_bad_flags_are_reported_together(short_dir: Path) -> None:
    result = run_agent(short_dir, "--metrics-address", "nowhere", "--ignored-xids", "13,x")
    assert result.returncode == 2
    assert "--metrics-address 'nowhere'" in result.stderr and "--ignored-xids" in result.stderr


def test_bad_simulate_spec(short_dir: Path) -> None:
    result = run_agent(short_dir, spec="2xH100")
    assert result.returncode == 1
    assert "expected COUNTxMODEL-MEMORYGB" in result.stderr


def test_metrics_port_in_use(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_agent(short_dir, "--metrics-address", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert not (short_dir / "dp" / "vcuda-core.sock").exists()
    assert not (short_dir / "sim" / "node.json").exists()


def test_kubernetes_mode_without_an_api_configuration_fails_clearly(short_dir: Path) -> None:
    missing = short_dir / "no-such-kubeconfig"
    dirs = ("--device-plugin-dir", str(short_dir / "dp"), "--sim-state-dir", str(short_dir / "sim"))
    result = run_cli("run", "--simulate", "1xT4-16GB", "--kubeconfig", str(missing), *dirs)
    assert result.returncode == 1
    assert f"cannot load the Kubernetes API configuration from kubeconfig {missing}" in result.stderr
    assert not (short_dir / "sim" / "node.json").exists()  # nothing left behind


def test_config_reload_keeps_old_config_on_error(start_agent: Start, short_dir: Path) -> None:
    config = short_dir / "config.json"
    config.write_text(json.dumps({"nodeConfig": [{"name": "test-node", "deviceMemoryScaling": 0.5}]}))
    agent = start_agent("1xT4-16GB", "--config", str(config))
    agent.wait_for_log(r"deviceMemoryScaling=0.5")
    config.write_text(json.dumps({"nodeConfig": [{"name": "test-node", "deviceMemoryScaling": 7}]}))
    agent.proc.send_signal(signal.SIGHUP)
    agent.wait_for_log(
        r"config reload rejected, keeping the current config: .*node 'test-node'.*deviceMemoryScaling"
    )
    assert agent.proc.poll() is None


def test_dump_bpf_prints_both_generated_programs() -> None:
    result = run_cli("run", "--no-kube", "--dump-bpf")
    assert result.returncode == 0, result.stderr
    assert "// ==== ioctl tracer ====" in result.stdout and "sys_enter_ioctl" in result.stdout
    assert "// ==== device guard (cgroup v2) ====" in result.stdout and "bpf_cgroup_dev_ctx" in result.stdout


@pytest.mark.privileged
def test_bpf_status_is_reported_and_a_load_failure_falls_back_to_nvml(
    start_agent: Start, short_dir: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for BPF")
    agent = start_agent("1xT4-16GB")
    port = agent.metrics_port()
    agent.wait_for_log(r"host: cgroup layout: \w+")
    assert _eventually(port, 'vcuda_bpf_status{node="test-node",status="ok"}') == 1.0
    agent.stop()
    empty = short_dir / "no-bpf-sources"
    empty.mkdir()
    broken = start_agent("1xT4-16GB", "--bpf-dir", str(empty))
    port = broken.metrics_port()
    broken.wait_for_log(r"running on NVML alone: .*ioctl_tracer\.c")
    assert _eventually(port, 'vcuda_bpf_status{node="test-node",status="load-failed"}') == 1.0
    assert len(re.findall("running on NVML alone", broken.log())) == 1


def _eventually(port: int, series: str, timeout_s: float = 30.0) -> float | None:
    """The sample once it is 1 (the tracer compiles in the background), else its last value."""
    deadline = time.monotonic() + timeout_s
    value = _sample(port, series)
    while value != 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
        value = _sample(port, series)
    return value


def _sample(port: int, series: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return None
