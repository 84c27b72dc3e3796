"""`vcuda-agent run` on a real node (NVML, not ``--simulate``) loads no GPU simulator, no
emulator and no demo (docs/architecture.md, "What the production path loads").

Each check runs in a fresh interpreter, so ``sys.modules`` holds only what that path
imported; NVML is the in-memory fake of ``tests/fakes/fake_nvml.py``, put where the agent
imports ``pynvml`` from, so the real backend factory and ``open_nvml_backend`` run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("agent.platform.gpu.sim", "agent.emulators", "agent.surfaces.cli.demo")

# Common to both scripts: NVML is the fake, and what was loaded is printed as JSON at the end.
PRELUDE = """
import json, sys
from pathlib import Path
from tests.fakes.fake_nvml import FakeGpu, FakeNvml
sys.modules["pynvml"] = FakeNvml([FakeGpu("GPU-0000aaaa-0000-0000-0000-000000000000", "00000000:07:00.0", 0)])
tmp = Path(sys.argv[1])
common = ["--node-name", "n1", "--device-plugin-dir", str(tmp / "dp"), "--state-dir", str(tmp / "state"),
          "--driver-root", str(tmp), "--sim-state-dir", str(tmp / "sim"), "--no-watchdog",
          "--no-ioctl-tracing", "--log-level", "WARNING"]
"""
REPORT = """
loaded = sorted(m for m in sys.modules if m.startswith(FORBIDDEN))
print(json.dumps({"loaded": loaded, "result": result}))
"""

# `vcuda-agent run` itself, through the console script's entry point, until SIGTERM: parse,
# settings, NodeAgent with the NVML backend, start (device plugin endpoint, metrics, host
# side, MPS supervision), stop. Without the Kubernetes API and the device guard, so that it
# touches nothing of this host but its temp dir.
RUN_COMMAND = """
import os, signal, threading
from agent.surfaces.cli.main import main
threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
result = main(["run", *common, "--no-kube", "--device-guard", "off", "--metrics-address", "127.0.0.1:0"])
"""

# Kubernetes mode with every integration built (API client, host side, enforcement, MPS
# sharing in auto mode, DRA), not started: the API server named in the kubeconfig is never
# dialled.
BUILD_KUBE_MODE = """
from agent.domain.nodeconfig import ClusterConfig
from agent.surfaces.cli.main import build_parser
from agent.surfaces.cli.run import settings_from_args
from agent.surfaces.node import NodeAgent
kubeconfig = tmp / "kubeconfig"
kubeconfig.write_text(json.dumps({
    "apiVersion": "v1", "kind": "Config", "current-context": "x",
    "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
}))
args = build_parser().parse_args([
    "run", *common, "--kubeconfig", str(kubeconfig), "--no-metrics", "--sharing-mode", "auto",
    "--pod-resources-socket", str(tmp / "pr.sock"), "--dra", "--dra-registry-dir", str(tmp / "reg"),
    "--dra-plugin-dir", str(tmp / "drap"), "--cdi-dir", str(tmp / "cdi"),
])
agent = NodeAgent(settings_from_args(args), ClusterConfig())
try:
    result = [agent.backend_name, agent.kube is not None, agent.dra is not None]
finally:
    agent.backend.close()
"""


def _run(script: str, tmp: Path) -> dict[str, object]:
    code = f"FORBIDDEN = {FORBIDDEN!r}\n{PRELUDE}{script}{REPORT}"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_run_on_nvml_loads_no_simulator_emulator_or_demo(short_dir: Path) -> None:
    report = _run(RUN_COMMAND, short_dir)
    assert report["result"] == 0  # stopped cleanly on SIGTERM
    assert report["loaded"] == []


def test_kubernetes_mode_agent_on_nvml_loads_none_of_them(short_dir: Path) -> None:
    report = _run(BUILD_KUBE_MODE, short_dir)
    assert report["result"] == ["nvml", True, True]
    assert report["loaded"] == []


def test_the_forbidden_names_are_real_packages() -> None:
    """A renamed package would make the checks above pass vacuously."""
    for name in ("agent.platform.gpu.sim", "agent.emulators", "agent.surfaces.cli.demo"):
        assert importlib.util.find_spec(name) is not None, name
    assert set(FORBIDDEN) == {"agent.platform.gpu.sim", "agent.emulators", "agent.surfaces.cli.demo"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], "sim-mps-control"),
        (["run", "--help"], "--sim-state-dir"),
        (["demo", "--help"], "in two acts"),
        (["sim-gpu", "--help"], "--driver-mps-v3"),
    ],
)
def test_help_loads_only_what_it_shows(argv: list[str], expected: str) -> None:
    """The subcommands' help renders from their declarations; ``run --help`` and the top-level
    help import no simulator or demo to do it."""
    code = (
        "import sys\n"
        "from agent.surfaces.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))\n"
        "print('LOADED', loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert expected in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "LOADED []"
