"""A real agent on a node whose simulated GPU 0 is in MIG mode (MIG strategy mixed): it reports
the MIG devices in its status, the node's inventory annotation, GPU feature discovery's labels
and its metrics, offers no shares of GPU 0, and an XID on one GPU instance makes that
instance Unhealthy, not the GPU."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.domain.nodeinventory import INVENTORY_ANNOTATION, NodeInventory, decode
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.surfaces.statusclient import fetch_status
from tests.conftest import AgentProcess
from tests.integration.kubecluster import NODE, Cluster, metric, scrape, wait_until
from tests.integration.migserver import mig_gpu_server

SPEC = "2xH100-80GB"


@pytest.fixture
def mig_gpus(short_dir: Path) -> Iterator[Path]:
    """The node's GPU server, GPU 0 in MIG mode with three instances; the agent attaches."""
    with mig_gpu_server(short_dir / "sim", SPEC, NODE, "0:3g.40gb,2g.20gb,1g.10gb", 10) as path:
        yield path


def inventory(cluster: Cluster) -> NodeInventory | None:
    text = (
        ((cluster.api.node(NODE) or {}).get("metadata") or {})
        .get("annotations", {})
        .get(INVENTORY_ANNOTATION)
    )
    return decode(text) if text else None


def labels(cluster: Cluster) -> dict[str, str]:
    return dict(((cluster.api.node(NODE) or {}).get("metadata") or {}).get("labels") or {})


def test_the_agent_reports_mig_devices_and_their_health(
    mig_gpus: Path, start_agent: Callable[..., AgentProcess], short_dir: Path, cluster: Cluster
) -> None:
    config = short_dir / "config.json"
    config.write_text(json.dumps({"nodeConfig": [{"name": NODE, "mig": {"strategy": "mixed"}}]}))
    agent = start_agent(SPEC, "--config", str(config), kube=cluster.kube)
    wait_until(lambda: labels(cluster).get("nvidia.com/mig.strategy") == "mixed", 30, "MIG labels")
    node_labels = labels(cluster)
    assert node_labels["nvidia.com/mig.capable"] == "true"
    assert {k: v for k, v in node_labels.items() if k.startswith("nvidia.com/mig-")} == {
        "nvidia.com/mig-1g.10gb.count": "1",
        "nvidia.com/mig-2g.20gb.count": "1",
        "nvidia.com/mig-3g.40gb.count": "1",
    }
    published = wait_until(lambda: inventory(cluster), what="the inventory annotation")
    mig0, mig1 = (g.mig for g in published.gpus)
    assert mig0 is not None and mig1 is not None
    assert (mig0.enabled, mig1.enabled) == (True, False)
    two = next(d for d in mig0.devices if d.profile == "2g.20gb")
    assert (two.placement, two.memory_mib, two.healthy) == ("0:2", 20096, True)  # the 3g went to 4:4

    port = agent.metrics_port()
    assert metric(scrape(port), "vcuda_mig_devices", gpu="0", profile="3g.40gb") == 1
    assert metric(scrape(port), "vcuda_gpu_mig_mode", gpu="1", state="current") == 0

    post_event(mig_gpus, 0, EventKind.XID.value, 48, "double-bit ECC", gpu_instance=two.gi)
    wait_until(
        lambda: metric(scrape(port), "vcuda_mig_device_healthy", gi=str(two.gi)) == 0, what="GI Unhealthy"
    )
    assert metric(scrape(port), "vcuda_gpu_healthy", gpu="0") == 1  # the GPU is not
    assert metric(scrape(port), "vcuda_mig_device_healthy", profile="3g.40gb") == 1  # nor its neighbours

    def unhealthy_in_annotation() -> Any:
        current = inventory(cluster)
        mig = current.gpus[0].mig if current is not None else None
        return mig is not None and not next(d for d in mig.devices if d.gi == two.gi).healthy

    wait_until(unhealthy_in_annotation, what="the annotation's device Unhealthy")
    status = fetch_status(short_dir / "agent-state" / "status.sock")
    gpu0 = status["gpus"][0]
    assert gpu0["health"] == "Healthy" and gpu0["mig"]["mode"] == "enabled"
    devices = {d["profile"]: d for d in gpu0["mig"]["devices"]}
    assert devices["2g.20gb"]["health"] == "Unhealthy" and "XID 48" in devices["2g.20gb"]["healthReason"]
    assert devices["3g.40gb"]["capDevices"] == [
        f"/dev/nvidia-caps/nvidia-cap{devices['3g.40gb']['gi'] * 9 + n}" for n in (3, 4)
    ]
    assert gpu0["mig"]["strategy"] == "mixed" and "in MIG mode" in gpu0["mig"]["shares"]
    assert status["gpus"][1]["mig"] == {
        "mode": "disabled", "pending": "disabled", "devices": [], "strategy": "mixed", "shares": None,
        "geometry": None,
    }  # fmt: skip
    # GPU 0 offers no shares: vcuda-memory is GPU 1's, and the annotation says 0 cores on GPU 0.
    assert (published.gpus[0].cores, published.gpus[0].schedulable_mib) == (0, 0)
    capacity = ((cluster.api.node(NODE) or {}).get("status") or {}).get("capacity") or {}
    assert capacity.get("nvidia.com/vcuda-memory") == str(published.gpus[1].schedulable_mib)
