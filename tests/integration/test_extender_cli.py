"""`vcuda-agent extender` as a real process against the fake API server: it becomes ready,
answers filter, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from tests.integration.extenderkit import args_names, get, inventory_text, payload, post
from tests.integration.kubeapi import apiserver, wait_until

__all__ = ["apiserver"]
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_extender_command_serves_until_sigterm(apiserver: FakeApiServer, tmp_path: Path) -> None:
    apiserver.create_node("gpu-a", annotations={INVENTORY_ANNOTATION: inventory_text("gpu-a", 2)})
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kc")
    port = free_port()
    command = [sys.executable, "-m", "agent", "extender", "--kubeconfig", str(kubeconfig)]
    command += ["--listen", f"127.0.0.1:{port}", "--node-policy", "spread", "--max-per-gpu", "4"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                return get(url, "/readyz")[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout_s=30, what="the extender process ready")
        status, result = post(url, "filter", args_names(payload("pod_share50.json"), ["gpu-a", "gpu-x"]))
        assert status == 200 and result["nodenames"] == ["gpu-a"]
        assert "gpu-x" in result["failedNodes"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode == 0, output


def test_bad_options_are_refused(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "agent", "extender", "--listen", "nowhere"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
