"""Hardware-isolated shares on demand, end to end: a real agent process on a simulated
2xH100-80GB node whose GPU 0 is in MIG mode and serves isolated shares (``mig.onDemand``),
the fake API server and the kubelet emulator over real unix-socket gRPC. Allocate of a pod
annotated ``nvidia.com/vcuda-isolation: mig`` makes a MIG instance for it (the simulator's
truth shows it) and answers with that MIG device; a second share gets its own; a share that
no longer fits, a bad annotation and a pod without the annotation on GPU 0 are refused with
why; deleting the pod destroys its instance; a restarted agent re-adopts the instances (and
with the CDI strategy the answer names the MIG device as CDI does)."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.domain.ids import decode
from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.domain.nodeinventory import decode as decode_inventory
from agent.emulators.kubelet import AdmissionError, PodAdmission
from agent.errors import VcudaError
from agent.platform.gpu.sim.client import NodeClient
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.channel import rpc_error_parts, unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent.surfaces.statusclient import fetch_status
from tests.conftest import AgentProcess
from tests.integration.kubecluster import NODE, Cluster, metric, pod_manifest, scrape, wait_until
from tests.integration.migserver import mig_gpu_server

SPEC = "2xH100-80GB"
ISOLATED = {"nvidia.com/vcuda-isolation": "mig"}
Start = Callable[..., AgentProcess]


@pytest.fixture
def sim_dir(short_dir: Path) -> Iterator[Path]:
    """The node's GPU server, GPU 0 in MIG mode with no instance; the agent attaches to it."""
    with mig_gpu_server(short_dir / "sim", SPEC, NODE, "0:", 20) as path:
        yield path


def instances(path: Path) -> dict[str, dict[str, Any]]:
    """The simulator's MIG devices on GPU 0 by UUID (its own state, not the agent's).

    ``mig_state`` and ``mig_truth`` are two calls, so an instance the agent destroys between
    them is in one and not the other: the pair counts only when the state read on both sides
    of the truth is the same, and then the two must agree.
    """
    client = NodeClient(path / "gpu.sock")
    try:
        for _ in range(50):
            before = _state(client)
            truth = {d["uuid"] for d in client.mig_truth()["devices"] if d["gpu"] == 0}
            state = _state(client)
            if set(before) == set(state):
                break
        else:
            raise AssertionError("the simulator's MIG devices kept changing")
    finally:
        client.close()
    assert set(state) == truth
    return state


def _state(client: NodeClient) -> dict[str, dict[str, Any]]:
    return {d["uuid"]: d for g in client.mig_state() if g["index"] == 0 for d in g["devices"]}


def start(start_agent: Start, cluster: Cluster, short_dir: Path, *extra: str) -> AgentProcess:
    config = short_dir / "config.json"
    mig = {"strategy": "mixed", "onDemand": [0]}
    config.write_text(json.dumps({"nodeConfig": [{"name": NODE, "mig": mig}]}))
    agent = start_agent(SPEC, "--config", str(config), *extra, kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    gpu0 = gpu_uuid(agent, 0)

    def listed() -> bool:  # by this agent's stream (a restarted agent's predecessor's has ended)
        core = cluster.kubelet.plugins["nvidia.com/vcuda-core"]
        return any(decode(i).gpu_uuid == gpu0 for i in core.healthy_ids())

    wait_until(listed, 20, "GPU 0's shares listed")
    return agent


def gpu_uuid(agent: AgentProcess, index: int) -> str:
    return next(g.uuid for g in SimNodeDir(agent.sim_dir).read_node().gpus if g.index == index)


def mig_uuid(admission: PodAdmission) -> str:
    return admission.containers[0].response.envs["NVIDIA_VISIBLE_DEVICES"]


def status_of(short_dir: Path) -> dict[str, Any] | None:
    try:
        return fetch_status(short_dir / "agent-state" / "status.sock")
    except VcudaError:
        return None  # not serving yet


def refused_events(cluster: Cluster) -> dict[str, str]:
    return {
        e["involvedObject"]["name"]: e["message"]
        for e in cluster.api.events("default")
        if e["reason"] == "GPUIsolationRefused"
    }


def test_isolated_shares_get_instances_of_their_own(
    sim_dir: Path, start_agent: Start, cluster: Cluster, short_dir: Path
) -> None:
    agent = start(start_agent, cluster, short_dir)
    first = cluster.node.run_pod(pod_manifest("iso-a", ("cuda", 30, 20000), annotations=ISOLATED))
    uuid = mig_uuid(first)
    made = instances(sim_dir)
    assert list(made) == [uuid] and made[uuid]["profile"] == "3g.40gb"  # 30% of 132 SMs: 60 SMs
    response = first.containers[0].response
    gi = made[uuid]["gi"]
    assert uuid.startswith("MIG-") and response.envs["VCUDA_ISOLATION"] == "mig"
    assert [d.container_path for d in response.devices] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{3 + 9 * gi}",  # gpu0/gi<G>/access
        f"/dev/nvidia-caps/nvidia-cap{3 + 9 * gi + 1}",  # gpu0/gi<G>/ci0/access
    ]

    second = cluster.node.run_pod(pod_manifest("iso-b", ("cuda", 30, 20000), annotations=ISOLATED))
    assert mig_uuid(second) != uuid and set(instances(sim_dir)) == {uuid, mig_uuid(second)}

    # Two 3g.40gb take all 8 memory slices: a third share does not fit, with migfit's reason.
    with pytest.raises(AdmissionError, match=r"no room on the GPU for a MIG instance of 3g\.40gb"):
        cluster.node.run_pod(pod_manifest("iso-c", ("cuda", 30, 20000), annotations=ISOLATED))
    with pytest.raises(AdmissionError, match=r"'MIG' is not valid: the only value is 'mig'"):
        cluster.node.run_pod(
            pod_manifest("iso-bad", ("cuda", 10, 1000), annotations={"nvidia.com/vcuda-isolation": "MIG"})
        )
    events = wait_until(lambda: len(refused_events(cluster)) == 2 and refused_events(cluster), what="events")
    assert "3g.40gb" in events["iso-c"] and "'MIG'" in events["iso-bad"]
    assert len(instances(sim_dir)) == 2  # nothing left behind by the refusals

    # A pod without the annotation is steered to GPU 1; on GPU 0 it is refused with why.
    plain = cluster.node.run_pod(pod_manifest("plain", ("cuda", 30, 20000)))
    assert {decode(i).gpu_uuid for i in plain.containers[0].device_ids} == {gpu_uuid(agent, 1)}
    cluster.node.create_pod(pod_manifest("plain-0", ("cuda", 10, 1000)))
    gpu0 = gpu_uuid(agent, 0)
    core = cluster.kubelet.plugins["nvidia.com/vcuda-core"]
    taken = cluster.kubelet.in_use("nvidia.com/vcuda-core")
    ids = sorted(i for i in core.devices if decode(i).gpu_uuid == gpu0 and i not in taken)[:10]
    with grpc.insecure_channel(unix_target(agent.plugin_dir / "vcuda-core.sock")) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(request, timeout=10)
    code, detail = rpc_error_parts(err.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "serves hardware-isolated shares only" in detail and "nvidia.com/vcuda-isolation: mig" in detail

    status = fetch_status(short_dir / "agent-state" / "status.sock")
    mig0 = status["gpus"][0]["mig"]
    assert mig0["onDemand"] is True and mig0["shares"] is None
    assert sorted((s["pod"], s["profile"], s["uuid"]) for s in mig0["isolated"]) == [
        ("default/iso-a", "3g.40gb", uuid),
        ("default/iso-b", "3g.40gb", mig_uuid(second)),
    ]
    port = agent.metrics_port()
    assert metric(scrape(port), "vcuda_mig_isolated_shares", gpu="0", profile="3g.40gb") == 2

    # The extender's view: GPU 0 on demand, no 3g.40gb left, the 1g profiles neither.
    def room() -> Any:
        text = (
            ((cluster.api.node(NODE) or {}).get("metadata") or {})
            .get("annotations", {})
            .get(INVENTORY_ANNOTATION)
        )
        entry = decode_inventory(text).gpus[0].mig if text else None
        return entry is not None and entry.on_demand and len(entry.devices) == 2 and entry.room

    assert wait_until(room, what="the inventory's room")["3g.40gb"] == 0

    # Deleting the pod destroys its instance.
    cluster.node.delete_pod("default", "iso-a")
    wait_until(lambda: uuid not in instances(sim_dir), what="iso-a's instance destroyed")
    assert set(instances(sim_dir)) == {mig_uuid(second)}


def test_a_restarted_agent_adopts_the_instances(
    sim_dir: Path, start_agent: Start, cluster: Cluster, short_dir: Path
) -> None:
    agent = start(start_agent, cluster, short_dir, "--device-list-strategy", "cdi")
    admission = cluster.node.run_pod(pod_manifest("kept", ("cuda", 20, 10000), annotations=ISOLATED))
    response = admission.containers[0].response
    kept = response.envs["VCUDA_MIG_DEVICES"]
    assert [d.name for d in response.cdi_devices] == [f"nvidia.com/gpu={kept}"]
    assert not response.devices and "NVIDIA_VISIBLE_DEVICES" not in response.envs
    assert instances(sim_dir)[kept]["profile"] == "2g.20gb"  # 20% of 132 SMs: 32 SMs
    assert agent.stop(signal.SIGTERM) == 0
    assert set(instances(sim_dir)) == {kept}  # an agent that stops leaves tenants' instances

    again = start(start_agent, cluster, short_dir, "--device-list-strategy", "cdi")
    again.wait_for_log(r"isolated share of default/kept/cuda: adopted 2g\.20gb " + kept)
    status = wait_until(lambda: status_of(short_dir), what="the status socket")
    assert [s["uuid"] for s in status["gpus"][0]["mig"]["isolated"]] == [kept]
    # The adopted instance is placed around: the next share gets a new one, and goes with its pod.
    following = cluster.node.run_pod(pod_manifest("next", ("cuda", 20, 10000), annotations=ISOLATED))
    other = following.containers[0].response.envs["VCUDA_MIG_DEVICES"]
    assert set(instances(sim_dir)) == {kept, other}
    cluster.node.delete_pod("default", "kept")
    wait_until(lambda: set(instances(sim_dir)) == {other}, what="the adopted instance destroyed")
