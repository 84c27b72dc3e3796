"""Kubernetes mode end to end: a real agent process, the fake API server (real kubernetes
client, real HTTP) and the kubelet emulator (real gRPC device plugin + pod-resources)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from agent.domain.ids import decode
from agent.emulators.kubelet import AdmissionError, PodAdmission
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.channel import rpc_error_parts, unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent.platform.kubelet.podresources import PodResourcesClient
from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster, metric, pod_annotations, pod_manifest, scrape, wait_until

Start = Callable[..., AgentProcess]
GIB = 1024


def start(start_agent: Start, cluster: Cluster) -> tuple[AgentProcess, int]:
    agent = start_agent("2xH100-80GB", "--log-level", "DEBUG", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    return agent, agent.metrics_port()


def event_messages(cluster: Cluster, reason: str) -> dict[str, str]:
    """Pod name -> message of the Events with ``reason`` in namespace default."""
    return {
        e["involvedObject"]["name"]: e["message"]
        for e in cluster.api.events("default")
        if e["reason"] == reason
    }


def gpu_indexes(agent: AgentProcess, ids: list[str]) -> set[int]:
    uuids = {g.uuid: g.index for g in SimNodeDir(agent.sim_dir).read_node().gpus}
    return {uuids[decode(i).gpu_uuid] for i in ids}


def gpus_of(agent: AgentProcess, admission: PodAdmission, container: int = 0) -> set[int]:
    return gpu_indexes(agent, admission.containers[container].device_ids)


def test_pods_are_matched_annotated_and_released(start_agent: Start, cluster: Cluster) -> None:
    agent, port = start(start_agent, cluster)
    big = cluster.node.run_pod(pod_manifest("big", ("cuda", 50, 60 * GIB)))
    small = cluster.node.run_pod(pod_manifest("small", ("cuda", 50, 30 * GIB)))
    # Binpacking by cores alone would put both on GPU 0; their memory does not fit there.
    assert gpus_of(agent, big) == {0} and gpus_of(agent, small) == {1}
    assert wait_until(lambda: pod_annotations(cluster.api, "small").get("nvidia.com/gpu-assigned") == "true")
    notes = pod_annotations(cluster.api, "small")
    assert (
        notes["nvidia.com/predicate-gpu-idx-0"] == "1" and notes["nvidia.com/predicate-node"] == "test-node"
    )
    text = scrape(port)
    assert metric(text, "vcuda_container_request_cores", pod="big", container="cuda", gpu="0") == 50
    assert metric(text, "vcuda_container_memory_quota_bytes", pod="small") == 30 * GIB * 2**20
    assert metric(text, "vcuda_gpu_memory_allocated_bytes", gpu="0") == 60 * GIB * 2**20
    cluster.node.delete_pod("default", "big")
    wait_until(lambda: metric(scrape(port), "vcuda_gpu_memory_allocated_bytes", gpu="0") == 0, what="release")
    assert metric(scrape(port), "vcuda_container_request_cores", pod="big") is None
    assert agent.proc.poll() is None


def test_a_predicated_pod_is_steered_to_its_gpu(start_agent: Start, cluster: Cluster) -> None:
    agent, _ = start(start_agent, cluster)
    notes = {"nvidia.com/predicate-gpu-idx-0": "1", "nvidia.com/predicate-time": "1700000000000000000"}
    placed = cluster.node.run_pod(pod_manifest("placed", ("cuda", 20, GIB), annotations=notes))
    assert gpus_of(agent, placed) == {1}  # plain binpacking would pick GPU 0
    assert wait_until(lambda: pod_annotations(cluster.api, "placed").get("nvidia.com/gpu-assigned") == "true")


def test_ids_that_disagree_with_the_predicate_are_refused(start_agent: Start, cluster: Cluster) -> None:
    agent, _ = start(start_agent, cluster)
    notes = {"nvidia.com/predicate-gpu-idx-0": "1", "nvidia.com/predicate-time": "1700000000000000000"}
    cluster.node.create_pod(pod_manifest("placed", ("worker", 10, GIB), annotations=notes))
    gpu0 = sorted(
        i for i in cluster.kubelet.plugins["nvidia.com/vcuda-core"].devices if i.endswith("-vcore-00")
    )
    ids = [d.replace("-vcore-00", f"-vcore-{n:02d}") for d in gpu0[:1] for n in range(10)]
    assert gpu_indexes(agent, ids) == {0}
    with grpc.insecure_channel(unix_target(agent.plugin_dir / "vcuda-core.sock")) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(request, timeout=10)
    code, detail = rpc_error_parts(err.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "pod default/placed container worker" in detail and "GPU 1" in detail and "GPU 0" in detail


def test_multi_container_pod_with_an_init_container(start_agent: Start, cluster: Cluster) -> None:
    start(start_agent, cluster)
    manifest = pod_manifest("multi", ("a", 30, GIB), ("b", 40, 2 * GIB), init=(("setup", 20, GIB),))
    admission = cluster.node.run_pod(manifest)
    assert [c.container for c in admission.containers] == ["setup", "a", "b"]
    notes = wait_until(
        lambda: (n := pod_annotations(cluster.api, "multi")).get("nvidia.com/gpu-assigned") == "true" and n
    )
    assert {
        "nvidia.com/predicate-gpu-idx-init-0",
        "nvidia.com/predicate-gpu-idx-0",
        "nvidia.com/predicate-gpu-idx-1",
    } <= set(notes)


def test_oversubscribing_memory_is_refused_with_an_event(start_agent: Start, cluster: Cluster) -> None:
    agent, _ = start(start_agent, cluster)
    with pytest.raises(AdmissionError) as err:
        cluster.node.run_pod(pod_manifest("greedy", ("cuda", 30, 90 * GIB)))
    assert "default/greedy/cuda needs 30 vcuda-core and 92160 MiB" in str(err.value)
    events = wait_until(
        lambda: [e for e in cluster.api.events("default") if e["reason"] == "GPUOversubscribed"]
    )
    assert events[0]["involvedObject"]["name"] == "greedy"
    assert cluster.node.run_pod(pod_manifest("fits", ("cuda", 30, 10 * GIB)))  # still serving
    assert agent.proc.poll() is None


def test_a_refused_pod_is_not_taken_for_the_next_pod_of_the_same_size(
    start_agent: Start, cluster: Cluster
) -> None:
    # kubelet rejects a pod whose Allocate failed for good, and marks it Failed a moment later;
    # until the agent's pod cache sees that, the refused pod is still Pending. The next pod
    # asking the same vcuda-core must get the IDs, not be matched to the refused one (CI).
    # Candidates rank by (creationTimestamp, whole seconds; namespace/name): the refused pod
    # ranks first whether the two are created in one second or two.
    agent, _ = start(start_agent, cluster)
    greedy = cluster.node.create_pod(pod_manifest("a-greedy", ("cuda", 30, 90 * GIB)))
    with pytest.raises(AdmissionError, match="default/a-greedy/cuda needs 30 vcuda-core"):
        cluster.kubelet.admit(greedy)  # kubelet's rejection, its status update not yet written
    refused = cluster.api.pod("default", "a-greedy")
    assert refused is not None and refused["status"]["phase"] == "Pending"
    fits = cluster.node.run_pod(pod_manifest("b-fits", ("cuda", 30, 10 * GIB)))
    assert fits.containers[0].response.envs["VCUDA_CORE"]
    wait_until(  # the annotator writes it after Allocate answered
        lambda: pod_annotations(cluster.api, "b-fits").get("nvidia.com/predicate-gpu-idx-0"),
        what="b-fits annotated with its GPU",
    )
    assert agent.proc.poll() is None


def test_bad_annotations_give_events_and_the_safe_default(start_agent: Start, cluster: Cluster) -> None:
    agent, port = start(start_agent, cluster)
    for name, limit in [("abc", "abc"), ("zero", "0"), ("big", "250"), ("neg", "-5")]:
        cluster.node.run_pod(
            pod_manifest(name, ("cuda", 10, GIB), annotations={"nvidia.com/vcuda-core-limit": limit})
        )

    def reasons() -> dict[str, str]:
        return event_messages(cluster, "InvalidGPUAnnotation")

    got = wait_until(lambda: len(reasons()) == 4 and reasons(), what="4 events")
    assert "'abc' is not a number" in got["abc"] and "'250' is out of range" in got["big"]
    text = scrape(port)
    for name in ("abc", "zero", "big", "neg"):
        assert metric(text, "vcuda_container_cap_ratio", pod=name) == pytest.approx(0.10)
        assert metric(text, "vcuda_container_policy_info", pod=name, policy="fixed-share") == 1
    assert agent.proc.poll() is None


def test_a_tenant_cannot_pick_best_effort_or_a_cap_above_its_request_by_default(
    start_agent: Start, cluster: Cluster
) -> None:
    """The default bounds (no node config): a tenant's own best-effort, and a cap above its
    request, are cut back with Events."""
    agent, port = start(start_agent, cluster)
    cluster.node.run_pod(
        pod_manifest("lazy", ("cuda", 10, GIB), annotations={"nvidia.com/vcuda-policy": "best-effort"})
    )
    cluster.node.run_pod(
        pod_manifest("taker", ("cuda", 10, GIB), annotations={"nvidia.com/vcuda-core-limit": "100"})
    )

    def bounded() -> dict[str, str]:
        return event_messages(cluster, "GPUAnnotationBounded")

    got = wait_until(lambda: len(bounded()) == 2 and bounded(), what="2 events")
    assert "best-effort is not allowed on this node" in got["lazy"]
    assert "capping at 10" in got["taker"]
    text = scrape(port)
    for name in ("lazy", "taker"):
        assert metric(text, "vcuda_container_cap_ratio", pod=name) == pytest.approx(0.10)
        assert metric(text, "vcuda_container_policy_info", pod=name, policy="fixed-share") == 1
    assert agent.proc.poll() is None


def test_watch_recovers_from_410_and_a_dropped_connection(start_agent: Start, cluster: Cluster) -> None:
    agent, _ = start(start_agent, cluster)
    cluster.node.run_pod(pod_manifest("before", ("cuda", 10, GIB)))
    cluster.api.compact()
    cluster.api.drop_watches()
    after = cluster.node.run_pod(pod_manifest("after", ("cuda", 10, GIB)))
    assert len(after.containers[0].device_ids) == 10
    agent.wait_for_log(r"Allocate: default/after/cuda gets 10 vcuda-core")


def test_restart_mid_allocation_rebuilds_the_ledger_from_kubelet(
    start_agent: Start, cluster: Cluster, short_dir: Path
) -> None:
    agent, _ = start(start_agent, cluster)
    cluster.node.run_pod(pod_manifest("first", ("cuda", 40, 4 * GIB)))
    cluster.node.run_pod(pod_manifest("whole", ("trainer", 100, None)))
    # kubelet allocates the next pod's devices; the agent dies before PreStartContainer.
    pending = cluster.node.create_pod(pod_manifest("second", ("cuda", 30, 8 * GIB)))
    plugin = cluster.kubelet.plugins["nvidia.com/vcuda-core"]
    free = [i for i in plugin.healthy_ids() if i not in cluster.kubelet.in_use(plugin.resource)]
    ids = [i for i in free if decode(i).gpu_uuid == decode(free[0]).gpu_uuid][:30]
    cluster.kubelet.pods[pending.uid] = pending  # what admit() does first
    cluster.kubelet.allocated[(pending.uid, "cuda", plugin.resource)] = ids
    plugin.stub.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    )
    agent.stop(signal.SIGKILL)
    registrations = len(cluster.kubelet.registrations)

    restarted = start_agent("2xH100-80GB", kube=cluster.kube)
    restarted.wait_for_log(r"ledger rebuilt from pod-resources: 3 containers")
    port = restarted.metrics_port()
    truth = PodResourcesClient(cluster.pod_resources).list("nvidia.com/vcuda-core")
    text = scrape(port)
    for record in truth:
        assert metric(
            text, "vcuda_container_request_cores", pod=record.pod, container=record.container
        ) == len(record.device_ids)
    per_gpu = sorted(metric(text, "vcuda_gpu_cores_allocated", gpu=g) or 0.0 for g in ("0", "1"))
    assert per_gpu == [70.0, 100.0]
    # The admission finishes against the new agent: PreStartContainer confirms it.
    assert cluster.kubelet.wait_for(lambda: len(cluster.kubelet.registrations) > registrations, 30)
    latest = cluster.kubelet.registrations[-1]
    assert cluster.kubelet.wait_for(
        lambda: (p := cluster.kubelet.plugins.get(plugin.resource)) is not None and p.request is latest, 30
    )
    plugin = cluster.kubelet.wait_for_plugin(timeout_s=30)
    plugin.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids))
    restarted.wait_for_log(r"PreStartContainer: 30 IDs on GPU \d confirmed")
