"""Static MIG through the device plugin, as a real agent process against the kubelet emulator
over real unix-socket gRPC: strategy mixed registers one resource per profile whose devices
are the MIG devices, Allocate hands out a MIG device's UUID and exactly its device nodes, the
GPU in MIG mode leaves vcuda-core, and an XID on a GPU instance makes its device Unhealthy;
strategy single offers MIG devices of one profile as nvidia.com/gpu, as CDI names; a
configured geometry is applied once the GPU is reset and then offered."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.domain.ids import decode
from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.pods import ContainerRequest, PodSpec
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.migstate import MigDevice
from agent.platform.gpu.sim.client import NodeClient, post_event, server_answers
from agent.platform.gpu.sim.nodefile import SimNodeDir
from tests.conftest import AgentProcess

SPEC = "2xH100-80GB"
Start = Callable[..., AgentProcess]


def serve_gpus(short_dir: Path, geometry: str) -> subprocess.Popen[bytes]:
    """The node's GPU server with GPU 0 in MIG mode (``geometry``); the agent attaches to it."""
    sim_dir = short_dir / "sim"
    cmd = [sys.executable, "-m", "agent", "sim-gpu", "--simulate", SPEC, "--node-name", "test-node"]
    proc = subprocess.Popen([*cmd, "--sim-state-dir", str(sim_dir), "--mig", f"0:{geometry}"])
    deadline = time.monotonic() + 20.0
    while not server_answers(sim_dir / "gpu.sock"):  # the server's socket, polled
        assert time.monotonic() < deadline and proc.poll() is None, "the GPU server did not answer"
        time.sleep(0.02)
    return proc


@pytest.fixture
def mig_gpus(short_dir: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """``request.param``: GPU 0's MIG geometry."""
    proc = serve_gpus(short_dir, request.param)
    yield short_dir / "sim"
    proc.terminate()
    proc.wait(timeout=10)


def config(short_dir: Path, strategy: str) -> Path:
    path = short_dir / "config.json"
    path.write_text(json.dumps({"nodeConfig": [{"name": "test-node", "mig": {"strategy": strategy}}]}))
    return path


def mig_devices(sim_dir: Path) -> dict[str, MigDevice]:
    return {d.profile: d for d in mig_devices_list(sim_dir)}


def mig_devices_list(sim_dir: Path) -> list[MigDevice]:
    client = NodeClient(sim_dir / "gpu.sock")
    try:
        return [MigDevice(**d) for g in client.mig_state() for d in g["devices"]]
    finally:
        client.close()


@pytest.mark.parametrize("mig_gpus", ["3g.40gb,2g.20gb,1g.10gb"], indirect=True)
def test_mixed_offers_one_resource_per_profile_and_allocates_a_whole_instance(
    mig_gpus: Path, start_agent: Start, kubelet: KubeletEmulator, short_dir: Path
) -> None:
    devices = mig_devices(mig_gpus)
    agent = start_agent(SPEC, "--config", str(config(short_dir, "mixed")))
    plugins = {p: kubelet.wait_for_plugin(f"nvidia.com/mig-{p}") for p in ("3g.40gb", "2g.20gb", "1g.10gb")}
    for profile, plugin in plugins.items():
        (listed,) = plugin.devices.values()
        assert devices[profile].uuid == listed.ID and listed.health == "Healthy"
        assert [n.ID for n in listed.topology.nodes] == [0]
        registered = next(r for r in kubelet.registrations if r.resource_name == plugin.resource)
        assert registered.endpoint == f"vcuda-mig-{profile}.sock"
    # GPU 0 is in MIG mode: vcuda-core has GPU 1's shares only.
    core = kubelet.wait_for_plugin()
    assert {decode(i).gpu_uuid for i in core.devices} == {agent_gpu_uuid(agent, 1)}
    agent.wait_for_log(r"GPU 0 offers no vcuda-core or vcuda-memory: in MIG mode")

    two = devices["2g.20gb"]
    admission = kubelet.admit(
        PodSpec("mig", containers=(ContainerRequest("c", 1),)), "nvidia.com/mig-2g.20gb"
    )
    response = admission.containers[0].response
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == two.uuid
    assert response.envs["VCUDA_MIG_DEVICES"] == two.uuid
    assert [d.container_path for d in response.devices] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{3 + 9 * two.gi}",  # gpu0/gi<G>/access
        f"/dev/nvidia-caps/nvidia-cap{3 + 9 * two.gi + 1}",  # gpu0/gi<G>/ci0/access
    ]
    assert list(two.cap_devices) == [d.container_path for d in response.devices][-2:]

    updates = len(plugins["2g.20gb"].updates)
    post_event(mig_gpus, 0, EventKind.XID.value, 48, "double-bit ECC", gpu_instance=two.gi)
    assert kubelet.wait_for(lambda: len(plugins["2g.20gb"].updates) > updates, 10.0)
    assert [d.health for d in plugins["2g.20gb"].devices.values()] == ["Unhealthy"]
    assert [d.health for d in plugins["3g.40gb"].devices.values()] == ["Healthy"]  # its neighbour


def agent_gpu_uuid(agent: AgentProcess, index: int) -> str:
    return next(g.uuid for g in SimNodeDir(agent.sim_dir).read_node().gpus if g.index == index)


@pytest.mark.parametrize("mig_gpus", ["1g.10gb,1g.10gb"], indirect=True)
def test_single_offers_mig_devices_of_one_profile_as_gpus(
    mig_gpus: Path, start_agent: Start, kubelet: KubeletEmulator, short_dir: Path
) -> None:
    uuids = sorted(d.uuid for d in mig_devices_list(mig_gpus))
    start_agent(SPEC, "--config", str(config(short_dir, "single")), "--device-list-strategy", "cdi")
    plugin = kubelet.wait_for_plugin("nvidia.com/gpu")
    assert sorted(plugin.devices) == uuids
    admission = kubelet.admit(PodSpec("two", containers=(ContainerRequest("c", 2),)), "nvidia.com/gpu")
    response = admission.containers[0].response
    assert sorted(d.name for d in response.cdi_devices) == [f"nvidia.com/gpu={u}" for u in uuids]
    assert not response.devices and "NVIDIA_VISIBLE_DEVICES" not in response.envs


def test_a_configured_geometry_is_applied_after_the_reset_and_offered(
    start_agent: Start, kubelet: KubeletEmulator, short_dir: Path
) -> None:
    path = short_dir / "config.json"
    mig = {"strategy": "mixed", "geometry": {"0": ["3g.40gb", "3g.40gb"]}}
    path.write_text(json.dumps({"nodeConfig": [{"name": "test-node", "mig": mig}]}))
    agent = start_agent(SPEC, "--config", str(path))
    core = kubelet.wait_for_plugin()
    agent.wait_for_log(r"MIG geometry pending: GPU 0: MIG mode is enabled, pending a GPU reset")
    # Pending MIG mode: GPU 0 takes no new shares.
    gpu1 = {agent_gpu_uuid(agent, 1)}
    assert kubelet.wait_for(lambda: {decode(i).gpu_uuid for i in core.devices} == gpu1, 10)
    client = NodeClient(agent.sim_dir / "gpu.sock")
    try:
        client.gpu_reset(0)  # what the admin does; the agent never resets a GPU
    finally:
        client.close()
    plugin = kubelet.wait_for_plugin("nvidia.com/mig-3g.40gb", timeout_s=30)
    assert sorted(plugin.devices) == sorted(d.uuid for d in mig_devices_list(agent.sim_dir))
    assert len(plugin.devices) == 2
    agent.wait_for_log(r"MIG geometry applied: GPU 0: created 3g\.40gb at 4:4, 3g\.40gb at 0:4")
