"""Settings from the command line: address and list parsing, defaults, all problems at once."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent.domain.health import DEFAULT_IGNORED_XIDS
from agent.errors import ConfigError
from agent.settings import DeviceListStrategy, Settings, parse_address, parse_int_set
from agent.surfaces.cli.main import build_parser
from agent.surfaces.cli.run import settings_from_args


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:5678", ("0.0.0.0", 5678)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("[::]:65535", ("::", 65535)),
        (":80", ("0.0.0.0", 80)),
        ("localhost:8080", ("localhost", 8080)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("nohost", "HOST:PORT"),
        ("h:99999", "0..65535"),
        ("h:65536", "0..65535"),
        ("h:x", "HOST:PORT"),
        ("h:", "HOST:PORT"),
        ("h:-1", "HOST:PORT"),
        ("", "HOST:PORT"),
    ],
)
def test_parse_address_rejects(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_address(text)
    assert len(info.value.problems) == 1
    assert repr(text) in info.value.problems[0]
    assert why in info.value.problems[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("13,31,43", {13, 31, 43}),
        (" 79 , 48 ,, ", {79, 48}),
        ("0", {0}),
        ("", set()),
        ("5,5", {5}),
    ],
)
def test_parse_int_set(text: str, expected: set[int]) -> None:
    assert parse_int_set(text, "--x") == frozenset(expected)


def test_parse_int_set_lists_every_bad_item() -> None:
    with pytest.raises(ConfigError) as info:
        parse_int_set("1,a,-2,3.5,4", "--ignored-xids")
    [problem] = info.value.problems
    assert problem.startswith("--ignored-xids: ")
    for bad in ("a", "-2", "3.5"):
        assert bad in problem


def settings(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["run", *argv]))


def test_run_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    s = settings()
    assert s.node_name == socket.gethostname()
    assert s.use_kube is True
    assert s.config_file is None
    assert s.plugin.directory == Path("/var/lib/kubelet/device-plugins")
    assert s.plugin.socket_path == Path("/var/lib/kubelet/device-plugins/vcuda-core.sock")
    assert s.plugin.kubelet_socket == Path("/var/lib/kubelet/device-plugins/kubelet.sock")
    assert s.plugin.device_list_strategy is DeviceListStrategy.MOUNTS
    assert s.plugin.driver_root == Path("/")
    assert s.plugin.driver_root_in_agent is None
    assert s.metrics.host == "0.0.0.0"
    assert s.metrics.port == 5678
    assert s.metrics.enabled is True
    assert s.health.ignored_xids == DEFAULT_IGNORED_XIDS
    assert s.simulation.spec is None


def test_run_options(tmp_path: Path) -> None:
    s = settings(
        "--node-name=n1",
        "--no-kube",
        "--no-metrics",
        f"--config={tmp_path / 'c.json'}",
        "--simulate=2xH100-80GB",
        f"--sim-state-dir={tmp_path}",
        "--device-plugin-dir=/tmp/dp",
        "--device-list-strategy=cdi",
        "--driver-root=/run/nvidia/driver",
        "--driver-root-in-agent=/driver",
        "--ignored-xids=13",
        "--metrics-address=[::1]:0",
        "--host-root=/host",
        "--kubelet-config=/host/k.yaml",
    )
    assert s.node_name == "n1"
    assert s.cgroups.host_root == Path("/host")
    assert s.cgroups.kubelet_config == Path("/host/k.yaml")
    assert s.use_kube is False
    assert s.metrics.enabled is False
    assert s.config_file == tmp_path / "c.json"
    assert s.simulation.spec == "2xH100-80GB"
    assert s.simulation.state_dir == tmp_path
    assert s.plugin.socket_path == Path("/tmp/dp/vcuda-core.sock")
    assert s.plugin.device_list_strategy is DeviceListStrategy.CDI
    assert s.plugin.driver_root == Path("/run/nvidia/driver")
    assert s.plugin.driver_root_in_agent == Path("/driver")
    assert s.health.ignored_xids == frozenset({13})
    assert (s.metrics.host, s.metrics.port) == ("::1", 0)


def test_node_name_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert settings().node_name == "gpu-node-7"
    assert settings("--node-name", "flag-wins").node_name == "flag-wins"


def test_every_bad_value_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        settings("--metrics-address=nohost", "--ignored-xids=79,x", "--control-max-cycle=60")
    problems = info.value.problems
    assert len(problems) == 3
    assert any("--metrics-address" in p and "nohost" in p for p in problems)
    assert any("--ignored-xids" in p and "x" in p for p in problems)
    assert any("--control-max-cycle" in p and "60" in p for p in problems)


def test_bad_strategy_is_rejected_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--device-list-strategy=runc"])
    assert info.value.code == 2
    assert "--device-list-strategy" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--help"], ["run", "demo", "sim-workload", "sim-event", "--version"], id="top"),
        pytest.param(
            ["run", "--help"],
            [
                "--simulate",
                "--no-kube",
                "--device-plugin-dir",
                "--metrics-address",
                "--config",
                "--node-name",
                "--device-list-strategy",
                "--driver-root",
                "--ignored-xids",
                "--sim-state-dir",
                "/var/lib/kubelet/device-plugins",
            ],
            id="run",
        ),
        pytest.param(["demo", "--help"], ["--workdir", "--simulate"], id="demo"),
        pytest.param(
            ["sim-workload", "--help"],
            ["--gpu", "--memory-mib", "--busy", "--duration", "--sim-state-dir"],
            id="sim-workload",
        ),
        pytest.param(
            ["sim-event", "--help"],
            ["--gpu", "--xid", "--lost", "--recover", "--sim-state-dir"],
            id="sim-event",
        ),
    ],
)
def test_help_renders(
    argv: list[str],
    expected: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vcuda-agent")
    for text in expected:
        assert text in out, text


def test_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_simulated_workloads_start_without_the_heavy_imports() -> None:
    """`python -m agent sim-workload` skips the full CLI: no Kubernetes client, gRPC, metrics."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "agent", "sim-workload", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--driver-ioctls" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    heavy = {m for m in imported if m.split(".")[0] in ("kubernetes", "grpc", "prometheus_client", "rich")}
    assert not heavy, sorted(heavy)[:10]
    assert "agent.surfaces.cli.sim" in imported
