"""The device plugin, as a real agent process, against the kubelet emulator over real unix sockets."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest

from agent.domain.ids import MAX_ID_LENGTH, decode
from agent.emulators.kubelet import AdmissionError, KubeletEmulator, PluginConnection
from agent.emulators.pods import ContainerRequest, PodSpec
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.channel import rpc_error_parts
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from tests.conftest import AgentProcess
from tests.integration.blocking import blocked_wait, task_named
from tests.integration.kubeapi import wait_until

Start = Callable[..., AgentProcess]


def gpu_of(agent: AgentProcess, device_id: str) -> int:
    uuids = {slot.uuid: slot.index for slot in SimNodeDir(agent.sim_dir).read_node().gpus}
    return uuids[decode(device_id).gpu_uuid]


def pod(cores: int, name: str = "p") -> PodSpec:
    return PodSpec(name=name, containers=(ContainerRequest("c", cores),))


def unhealthy(plugin: PluginConnection) -> int:
    return sum(1 for d in plugin.devices.values() if d.health != "Healthy")


def test_registration_fields(start_agent: Start, kubelet: KubeletEmulator) -> None:
    start_agent()
    plugin = kubelet.wait_for_plugin()
    request = kubelet.registrations[0]
    assert request.version == "v1beta1"
    assert request.endpoint == "vcuda-core.sock"
    assert request.resource_name == "nvidia.com/vcuda-core"
    assert request.options.pre_start_required is True
    assert request.options.get_preferred_allocation_available is True
    assert plugin.options == request.options


def test_list_and_watch_contents(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent("8xH100-80GB")
    plugin = kubelet.wait_for_plugin()
    assert len(plugin.devices) == 800
    per_gpu: dict[int, int] = {}
    for device in plugin.devices.values():
        assert len(device.ID) <= MAX_ID_LENGTH
        assert device.health == "Healthy"
        index = gpu_of(agent, device.ID)
        per_gpu[index] = per_gpu.get(index, 0) + 1
        # The simulated 8-GPU node puts GPUs 0-3 on NUMA node 0 and 4-7 on NUMA node 1.
        assert [n.ID for n in device.topology.nodes] == [index // 4]
    assert per_gpu == dict.fromkeys(range(8), 100)


def test_health_change_reaches_kubelet_within_a_second(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    plugin = kubelet.wait_for_plugin()
    updates = len(plugin.updates)

    post_event(agent.sim_dir, 1, EventKind.XID.value, xid=13)  # application error: ignored by policy
    assert not kubelet.wait_for(lambda: len(plugin.updates) > updates, 1.5)

    started = time.monotonic()
    post_event(agent.sim_dir, 1, EventKind.XID.value, xid=79)
    assert kubelet.wait_for(lambda: len(plugin.updates) > updates, 1.0)
    assert plugin.updates[-1] - started < 1.0
    bad = {gpu_of(agent, d.ID) for d in plugin.devices.values() if d.health == "Unhealthy"}
    assert bad == {1}
    assert unhealthy(plugin) == 100

    post_event(agent.sim_dir, 1, EventKind.RECOVERED.value)
    assert kubelet.wait_for(lambda: unhealthy(plugin) == 0, 1.0)


def test_lost_gpu_is_refused(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    plugin = kubelet.wait_for_plugin()
    post_event(agent.sim_dir, 0, EventKind.LOST.value)
    assert kubelet.wait_for(lambda: unhealthy(plugin) == 100, 1.0)
    gpu0 = sorted(d.ID for d in plugin.devices.values() if gpu_of(agent, d.ID) == 0)
    with pytest.raises(grpc.RpcError) as err:
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=gpu0)])
        )
    code, details = rpc_error_parts(err.value)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU 0" in details and "Unhealthy" in details
    # The emulator, like kubelet, only offers healthy IDs: a whole-GPU pod gets GPU 1.
    admission = kubelet.admit(pod(100))
    assert {gpu_of(agent, i) for i in admission.containers[0].device_ids} == {1}


def test_preferred_allocation_and_allocate(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    kubelet.wait_for_plugin()

    pods = [pod(30, "share"), pod(60, "share2"), pod(100, "whole")]
    share = kubelet.admit(pods[0]).containers[0]
    assert len(share.device_ids) == 30 and share.preferred == share.device_ids
    (gpu,) = {gpu_of(agent, i) for i in share.device_ids}
    paths = [d.container_path for d in share.response.devices]
    assert paths == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", f"/dev/nvidia{gpu}"]
    assert all(d.permissions == "rw" for d in share.response.devices)
    assert share.response.envs["VCUDA_CORE"] == "30"

    # Binpack: a second share lands on the GPU that is already in use.
    second = kubelet.admit(pods[1]).containers[0]
    assert {gpu_of(agent, i) for i in second.device_ids} == {gpu}

    whole = kubelet.admit(pods[2]).containers[0]
    assert {gpu_of(agent, i) for i in whole.device_ids} == {1 - gpu}
    assert [d.container_path for d in whole.response.devices][-1] == f"/dev/nvidia{1 - gpu}"

    for admitted in pods:
        kubelet.release(admitted)
    both = kubelet.admit(pod(200, "both")).containers[0]
    assert {gpu_of(agent, i) for i in both.device_ids} == {0, 1}
    assert len(both.response.devices) == 5
    uuids = both.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(uuids) == 2 and both.response.envs["VCUDA_GPU_UUIDS"] == ",".join(uuids)


def test_invalid_requests_get_the_rule(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    plugin = kubelet.wait_for_plugin()
    with pytest.raises(AdmissionError, match=r"150 vcuda-core is invalid.*below 100.*multiple of 100"):
        kubelet.admit(pod(150))
    assert kubelet.allocated == {}

    ids = sorted(plugin.devices)
    spread = [i for i in ids if gpu_of(agent, i) == 0][:25] + [i for i in ids if gpu_of(agent, i) == 1][:25]
    with pytest.raises(grpc.RpcError) as err:
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=spread)])
        )
    code, details = rpc_error_parts(err.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "must take all its IDs from one GPU" in details

    with pytest.raises(grpc.RpcError) as err:
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids[:150])])
        )
    assert "multiple of 100" in rpc_error_parts(err.value)[1]

    with pytest.raises(grpc.RpcError) as err:
        plugin.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["not-an-id"]))
    assert "not a vcuda-core device ID" in rpc_error_parts(err.value)[1]
    # The agent keeps serving after bad requests.
    assert len(kubelet.admit(pod(50)).containers[0].device_ids) == 50


def test_share_that_fits_nowhere_is_refused(start_agent: Start, kubelet: KubeletEmulator) -> None:
    start_agent()
    kubelet.wait_for_plugin()
    kubelet.admit(pod(60, "a"))
    kubelet.admit(pod(60, "b"))
    with pytest.raises(
        AdmissionError, match=r"no single GPU has 50 free vcuda-core units .*GPU 0: 40, GPU 1: 40"
    ):
        kubelet.admit(pod(50, "c"))


def registered_more_than(kubelet: KubeletEmulator, count: int) -> bool:
    return len(kubelet.registrations) > count


def test_fifty_kubelet_restarts(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    kubelet.wait_for_plugin()
    # Start-up is over once the tracer compiled (it opens its BPF fds in the background).
    agent.wait_for_log(r"ioctl tracer attached|running on NVML alone", timeout_s=30)
    baseline: tuple[int, int] | None = None
    for round_ in range(1, 51):
        before = len(kubelet.registrations)
        started = time.monotonic()
        kubelet.restart()
        assert kubelet.wait_for(partial(registered_more_than, kubelet, before), 1.0), f"restart {round_}"
        plugin = kubelet.wait_for_plugin(timeout_s=1.0)
        assert time.monotonic() - started < 1.0, f"restart {round_} took {time.monotonic() - started:.2f} s"
        assert len(plugin.devices) == 200
        if round_ == 5:
            time.sleep(0.3)
            baseline = (agent.threads(), agent.fds())
    time.sleep(0.3)
    assert baseline is not None
    threads, fds = agent.threads(), agent.fds()
    assert threads <= baseline[0] + 1, f"threads grew from {baseline[0]} to {threads}"
    assert fds <= baseline[1] + 1, f"file descriptors grew from {baseline[1]} to {fds}"
    assert len(kubelet.registrations) == 51
    assert agent.stop() == 0


def test_plugin_socket_deleted_is_served_again(start_agent: Start, kubelet: KubeletEmulator) -> None:
    agent = start_agent()
    kubelet.wait_for_plugin()
    (agent.plugin_dir / "vcuda-core.sock").unlink()
    before = len(kubelet.registrations)
    assert kubelet.wait_for(lambda: len(kubelet.registrations) > before, 1.0)
    assert (agent.plugin_dir / "vcuda-core.sock").is_socket()
    assert len(kubelet.wait_for_plugin(timeout_s=1.0).devices) == 200


def test_a_registered_endpoint_sleeps_until_its_directory_changes(
    start_agent: Start, kubelet: KubeletEmulator
) -> None:
    agent = start_agent()
    kubelet.wait_for_plugin()
    tid = wait_until(lambda: task_named(agent.pid, "plugin-endpoint"), what="the endpoint's thread")
    wait_until(lambda: blocked_wait(tid, agent.pid) is True, what="the endpoint asleep with no timeout")
    before = len(kubelet.registrations)
    (agent.plugin_dir / "vcuda-core.sock").unlink()  # a change of the directory still wakes it
    assert kubelet.wait_for(lambda: len(kubelet.registrations) > before, 5.0)
    assert (agent.plugin_dir / "vcuda-core.sock").is_socket()
    assert agent.stop() == 0  # and stop() does


def test_agent_registers_when_kubelet_comes_up_later(start_agent: Start, short_dir: Path) -> None:
    agent = start_agent()
    agent.wait_for_log(r"waiting for kubelet")
    emulator = KubeletEmulator(short_dir / "dp")
    emulator.start()
    try:
        assert emulator.wait_for(lambda: len(emulator.registrations) == 1, 1.0)
    finally:
        emulator.stop()
