"""A real agent (simulated GPUs, Kubernetes mode against the emulators) given a toolkit
config.toml that leaves the NVIDIA_VISIBLE_DEVICES hole open: its status endpoint, its
/metrics and its log say so."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.platform.toolkitconfig import ENVVAR_KEY
from agent.surfaces.statusclient import StatusUnavailableError, fetch_status
from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster, metric, scrape, wait_until


def test_status_and_metrics_report_an_open_hole(
    start_agent: Callable[..., AgentProcess], cluster: Cluster, short_dir: Path
) -> None:
    toolkit = short_dir / "config.toml"
    toolkit.write_text('[nvidia-container-runtime]\nmode = "cdi"\n')  # the key unset: true
    agent = start_agent("2xH100-80GB", "--nvidia-toolkit-config", str(toolkit), kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    agent.wait_for_log(r"NVIDIA_VISIBLE_DEVICES hole open: .*is unset \(true by default\)")
    socket = agent.plugin_dir.parent / "agent-state" / "status.sock"  # sim_agent_command's --state-dir

    def hole() -> dict[str, str] | None:
        try:
            found: dict[str, str] = fetch_status(socket)["agent"]["visibleDevicesHole"]
        except StatusUnavailableError:
            return None
        return found

    shown = wait_until(hole, timeout_s=30, what="the status endpoint")
    assert shown["state"] == "open"
    assert str(toolkit) in shown["detail"] and f"set {ENVVAR_KEY} = false" in shown["detail"]
    text = scrape(agent.metrics_port())
    assert metric(text, "vcuda_nvidia_visible_devices_hole", state="open") == 1
    assert metric(text, "vcuda_nvidia_visible_devices_hole", state="closed") == 0
