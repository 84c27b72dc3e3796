"""A tenant's ``nvidia.com/predicate-time`` on its own pod no longer wins the
Allocate of another pod, and a container whose Allocate answer was made for another pod is not
started (PreStartContainer refuses it). A real agent process, the fake API server and the
kubelet emulator's device-plugin and pod-resources gRPC."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from agent.emulators.kubelet import AdmissionError
from agent.platform.kubelet.channel import rpc_error_parts
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster, pod_annotations, pod_manifest, wait_until
from tests.integration.test_faults_kube import ledger_rows, truth_rows
from tests.integration.test_kube_allocation import event_messages, start

Start = Callable[..., AgentProcess]
GIB = 1024
FORGED = {"nvidia.com/predicate-time": "1", "nvidia.com/gpu-assigned": "false"}


def created_second(cluster: Cluster, name: str) -> str:
    pod = cluster.api.pod("default", name)
    assert pod is not None
    return str(pod["metadata"]["creationTimestamp"])


def test_a_forged_predicate_time_does_not_win_a_victims_allocate(
    start_agent: Start, cluster: Cluster
) -> None:
    agent, port = start(start_agent, cluster)
    victim = cluster.node.create_pod(pod_manifest("victim", ("cuda", 30, 8 * GIB)))
    # The tenant's pod is younger (creationTimestamp has whole seconds) and names itself the
    # oldest bind there is; both wait on the node when kubelet admits the victim.
    when = created_second(cluster, "victim")
    wait_until(lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) != when, 3.0, "the next second")
    attacker = cluster.node.create_pod(pod_manifest("attacker", ("cuda", 30, GIB), annotations=FORGED))
    assert created_second(cluster, "attacker") > when
    step = cluster.kubelet.allocate(victim, "cuda")
    agent.wait_for_log(r"Allocate: default/victim/cuda gets 30 vcuda-core")
    cluster.kubelet.pre_start(step.device_ids)  # kubelet's pod-resources agrees: it starts
    agent.wait_for_log(r"PreStartContainer: 30 IDs on GPU \d confirmed")
    cluster.node.mark_running(victim)
    cluster.node.admit(attacker)  # the tenant's own pod still gets its own share
    agent.wait_for_log(r"Allocate: default/attacker/cuda gets 30 vcuda-core")
    assert ledger_rows(port) == truth_rows(cluster.pod_resources)
    assert wait_until(lambda: pod_annotations(cluster.api, "victim").get("nvidia.com/gpu-assigned") == "true")
    assert "GPUAllocationMismatch" not in {e["reason"] for e in cluster.api.events("default")}


def test_a_container_whose_allocate_was_for_another_pod_is_not_started(
    start_agent: Start, cluster: Cluster
) -> None:
    """Two alike pods wait on the node; kubelet admits the younger one, the agent's guess (the
    older) is wrong. kubelet keeps that Allocate answer, so the container would run with the
    other pod's environment: PreStartContainer refuses it, every time it is retried."""
    agent, port = start(start_agent, cluster)
    first = cluster.node.create_pod(pod_manifest("first", ("cuda", 30, 8 * GIB)))
    second = cluster.node.create_pod(pod_manifest("second", ("cuda", 30, GIB)))
    step = cluster.kubelet.allocate(second, "cuda")
    agent.wait_for_log(r"Allocate: default/first/cuda gets 30 vcuda-core")
    plugin = cluster.kubelet.plugins["nvidia.com/vcuda-core"]
    request = pb.PreStartContainerRequest(devices_ids=step.device_ids)
    for _ in range(2):  # kubelet retries the start with the answer it kept: refused again
        with pytest.raises(grpc.RpcError) as err:
            plugin.stub.PreStartContainer(request, timeout=30)
        code, detail = rpc_error_parts(err.value)
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        assert "pod default/second container cuda" in detail and "default/first/cuda" in detail
    agent.wait_for_log(r"PreStartContainer refused: kubelet starts pod default/second")
    # The ledger follows kubelet all the same, and the pod is told why it does not start.
    assert ledger_rows(port) == truth_rows(cluster.pod_resources)
    assert wait_until(
        lambda: "delete the pod" in event_messages(cluster, "GPUAllocationMismatch").get("second", "")
    )
    with pytest.raises(AdmissionError, match="Allocate answer was made for default/first/cuda"):
        cluster.kubelet.pre_start(step.device_ids)  # the emulated kubelet's own start step
    # The pod the agent had guessed is still admitted right, and starts.
    cluster.node.admit(first)
    agent.wait_for_log(r"PreStartContainer: 30 IDs on GPU \d confirmed")
    assert ("first", "cuda") in ledger_rows(port) and agent.proc.poll() is None


def test_alike_pods_guessed_the_other_way_round_start(start_agent: Start, cluster: Cluster) -> None:
    """Two pods with the same request and annotations: the answer made for one is the answer
    the other would get, so a wrong guess blocks nobody; the ledger follows kubelet."""
    agent, port = start(start_agent, cluster)
    cluster.node.create_pod(pod_manifest("first", ("cuda", 30, GIB)))
    second = cluster.node.create_pod(pod_manifest("second", ("cuda", 30, GIB)))
    step = cluster.kubelet.allocate(second, "cuda")
    agent.wait_for_log(r"Allocate: default/first/cuda gets 30 vcuda-core")
    cluster.kubelet.pre_start(step.device_ids)
    agent.wait_for_log(r"PreStartContainer: default/second/cuda starts with the answer made for default/f")
    assert ledger_rows(port) == truth_rows(cluster.pod_resources)
    assert "GPUAllocationMismatch" not in {e["reason"] for e in cluster.api.events("default")}
