"""Faults of the Kubernetes side survived by a real agent process (docs/security.md, "Faults
survived"):
the API server away for a minute, kubelet's pod-resources answering slowly, and the agent
SIGKILLed at every step of Allocate -> annotate -> PreStartContainer -> running.

Everything goes over the real wires: the fake API server (HTTP), the kubelet emulator's
device-plugin and pod-resources gRPC on unix sockets, the agent's /metrics and status socket.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen, wait_for
from agent.emulators.enforcednode import pod_manifest as enforced_manifest
from agent.emulators.kubelet import ContainerAdmission, PodAdmission
from agent.emulators.pods import PodSpec
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.podresources import PodResourcesClient
from agent.surfaces.statusclient import fetch_status
from tests.conftest import AgentProcess
from tests.integration.cgroup_trees import real_layout
from tests.integration.kubecluster import Cluster, metric, pod_annotations, pod_manifest, scrape, wait_until
from tests.integration.test_kube_allocation import gpu_indexes

Start = Callable[..., AgentProcess]
GIB = 1024
OUTAGE_S = 60.0  # the fault table's row: the API server unreachable for a minute
RECONNECT_S = 40.0  # the reflector's back-off is capped at 30 s; a retry is due within that
QUICK_S = 2.0  # what "keeps answering" means for one request on this 2-core machine
SLOW_S = 8.0  # kubelet's pod-resources answers this late: past the agent's 5 s call timeout
ASSIGNED = "nvidia.com/gpu-assigned"


def state_dir(agent: AgentProcess) -> Path:
    return agent.plugin_dir.parent / "agent-state"  # sim_agent_command's --state-dir


def ledger_rows(port: int) -> dict[tuple[str, str], float]:
    """(pod, container) -> vcuda-core, as the agent's /metrics show its ledger."""
    rows: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(scrape(port)):
        if family.name == "vcuda_container_request_cores":
            for sample in family.samples:
                key = (sample.labels["pod"], sample.labels["container"])
                rows[key] = rows.get(key, 0.0) + sample.value
    return rows


def truth_rows(socket: Path) -> dict[tuple[str, str], float]:
    """(pod, container) -> vcuda-core, as kubelet's pod-resources says it assigned them."""
    client = PodResourcesClient(socket, timeout_s=30.0)
    try:
        return {(r.pod, r.container): float(len(r.device_ids)) for r in client.list("nvidia.com/vcuda-core")}
    finally:
        client.close()


def assert_handed_out(agent: AgentProcess, step: ContainerAdmission, cores: int) -> None:
    """Allocate's answer gives the container its share of the GPU its IDs are on."""
    (gpu,) = gpu_indexes(agent, step.device_ids)
    uuid = SimNodeDir(agent.sim_dir).read_node().gpu(gpu).uuid
    assert len(step.device_ids) == cores
    assert dict(step.response.envs) | {"VCUDA_CORE": str(cores), "VCUDA_GPU_UUIDS": uuid} == dict(
        step.response.envs
    )
    assert f"/dev/nvidia{gpu}" in {d.container_path for d in step.response.devices}


def timed(call: Callable[[], Any]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def patch_refused(api: FakeApiServer, pod: str) -> bool:
    """The agent has tried (and failed) to write the pod's annotations."""
    path = f"/api/v1/namespaces/default/pods/{pod}"
    return any(r.method == "PATCH" and r.path == path and r.status >= 500 for r in api.request_log)


def outage_lines(log: str, since: int) -> list[str]:
    """The log lines written after character ``since`` that are about the API server failing."""
    about = re.compile(r"did not answer|unreachable|Connection refused|Retrying|retrying|Traceback")
    return [line for line in log[since:].splitlines() if about.search(line)]


@pytest.mark.slow
def test_the_api_server_away_for_a_minute(start_agent: Start, cluster: Cluster) -> None:
    agent = start_agent("2xH100-80GB", kube=cluster.kube)  # INFO: the log a node really writes
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    port = agent.metrics_port()
    kubelet, node, api = cluster.kubelet, cluster.node, cluster.api
    node.run_pod(pod_manifest("steady", ("cuda", 20, GIB)))
    node.run_pod(pod_manifest("doomed", ("cuda", 30, GIB)))
    # A two-container pod: its first container is allocated before the outage (so the agent's
    # cache provably knows the pod), its second during it.
    split: PodSpec = node.create_pod(pod_manifest("split", ("a", 10, GIB), ("b", 15, GIB)))
    kubelet.allocate(split, "a")
    wait_until(lambda: "nvidia.com/predicate-gpu-idx-0" in pod_annotations(api, "split"), what="first write")

    since = len(agent.log())
    api.stop()
    down = time.monotonic()
    second = kubelet.allocate(split, "b")  # real gRPC Allocate while the API server is gone
    assert_handed_out(agent, second, 15)
    kubelet.pre_start(second.device_ids)
    agent.wait_for_log(r"Allocate: default/split/b gets 15 vcuda-core")
    # What changes in the store while the agent cannot see it.
    node.delete_pod("default", "doomed")
    late = node.create_pod(pod_manifest("late", ("cuda", 25, GIB)))
    status = state_dir(agent) / "status.sock"
    while time.monotonic() - down < OUTAGE_S:
        started = time.monotonic()
        assert metric(scrape(port), "vcuda_container_request_cores", pod="split", container="b") == 15
        assert fetch_status(status)["agent"]["pid"] == agent.pid
        assert time.monotonic() - started < QUICK_S, "/metrics and status answer at once"
        assert agent.proc.poll() is None
        time.sleep(1.0)  # a probe per second, as a kubelet and Prometheus would
    written = agent.log()[since:].splitlines()
    noise = outage_lines(agent.log(), since)
    back = len(api.request_log)
    api.start()

    # About one WARNING per component that talks to the API (pod and node watches, node
    # publisher, annotator), not one per try: no traceback, no storm.
    assert not [line for line in written if "Traceback" in line]
    assert 1 <= len(noise) <= 8, "\n".join(noise)
    assert len(written) <= 30, "\n".join(written)
    assert any("watch pods on node test-node failed: the API server did not answer" in line for line in noise)
    # Back: the agent resumes its watch where it was (the server still has that history, so no
    # re-list), sees what happened meanwhile and writes what it owed.
    agent.wait_for_log(
        r"pods on node test-node: the API server answers again after \d+ failed tries", RECONNECT_S
    )
    wait_until(lambda: ("doomed", "cuda") not in ledger_rows(port), 10.0, "doomed released")
    pods = [r for r in api.request_log[back:] if r.path == "/api/v1/pods"]
    assert pods and all(r.is_watch and r.query.get("resourceVersion") for r in pods), pods
    wait_until(lambda: pod_annotations(api, "split").get(ASSIGNED) == "true", 20.0, "the owed annotation")
    assert {int(pod_annotations(api, "split")["nvidia.com/predicate-gpu-idx-1"])} == gpu_indexes(
        agent, second.device_ids
    )
    node.admit(late)
    agent.wait_for_log(r"Allocate: default/late/cuda gets 25 vcuda-core")
    wait_until(lambda: pod_annotations(api, "late").get(ASSIGNED) == "true", 10.0, "late annotated")
    assert ledger_rows(port) == truth_rows(cluster.pod_resources)
    assert agent.proc.poll() is None


def test_kubelet_slow_to_answer_pod_resources(start_agent: Start, cluster: Cluster) -> None:
    agent = start_agent("2xH100-80GB", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    port = agent.metrics_port()
    kubelet, node, api = cluster.kubelet, cluster.node, cluster.api
    server = kubelet.pod_resources
    assert server is not None
    node.run_pod(pod_manifest("steady", ("cuda", 20, GIB)))
    agent.wait_for_log(r"PreStartContainer: 20 IDs on GPU \d confirmed")
    # Two alike pods, kubelet admits the second: the agent's guess (oldest first) is wrong, and
    # only pod-resources can tell it so.
    first = node.create_pod(pod_manifest("first", ("cuda", 30, GIB)))
    second = node.create_pod(pod_manifest("second", ("cuda", 30, GIB)))
    server.set_delay(SLOW_S)
    step = kubelet.allocate(second, "cuda")
    agent.wait_for_log(r"Allocate: default/first/cuda gets 30 vcuda-core")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pre_start = pool.submit(timed, lambda: kubelet.pre_start(step.device_ids))
        wait_until(lambda: server.calls["Get"] >= 1, what="the agent asking kubelet")
        # While that PreStartContainer waits on kubelet, everything else answers at once.
        other = node.create_pod(pod_manifest("other", ("cuda", 10, GIB)))
        started = time.monotonic()
        other_step = kubelet.allocate(other, "cuda")
        probes = {
            "Allocate": time.monotonic() - started,
            "/metrics": timed(lambda: scrape(port)),
            "status": timed(lambda: fetch_status(state_dir(agent) / "status.sock")),
        }
        waiting = not pre_start.done()
        assert all(t < QUICK_S for t in probes.values()), probes
        assert waiting, "the probes did not overlap the slow PreStartContainer"
        assert_handed_out(agent, other_step, 10)
        # The agent's own timeout, well inside kubelet's 30 s for PreStartContainer.
        assert pre_start.result(timeout=30) < 10.0
    agent.wait_for_log(r"pod-resources API is not answering \(.*DEADLINE_EXCEEDED")
    # Once kubelet is known to be slow, PreStartContainer does not wait on it at all.
    assert timed(lambda: kubelet.pre_start(other_step.device_ids)) < QUICK_S
    assert ledger_rows(port)[("first", "cuda")] == 30  # still the wrong guess: nobody could tell

    server.set_delay(0)
    wait_until(lambda: ledger_rows(port) == truth_rows(cluster.pod_resources), 20.0, "the ledger corrected")
    agent.wait_for_log(r"pod-resources API answers again")
    assert metric(scrape(port), "vcuda_ledger_corrections_total") == 1
    wait_until(lambda: pod_annotations(api, "second").get(ASSIGNED) == "true", 10.0, "second annotated")
    assert pod_annotations(api, "first")[ASSIGNED] == "false"
    node.admit(first)  # the pod the agent had guessed wrong is still admitted right
    wait_until(lambda: ledger_rows(port) == truth_rows(cluster.pod_resources), 10.0, "first recorded")
    assert ("first", "cuda") in ledger_rows(port) and agent.proc.poll() is None


def test_a_restart_while_kubelet_is_slow_converges_once_it_answers(
    start_agent: Start, cluster: Cluster
) -> None:
    """The agent dies between Allocate and its annotation write, and comes back while kubelet's
    pod-resources is slow: its rebuild falls back to the annotations, which miss that pod."""
    agent = start_agent("2xH100-80GB", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    kubelet, node, api = cluster.kubelet, cluster.node, cluster.api
    server = kubelet.pod_resources
    assert server is not None
    node.run_pod(pod_manifest("steady", ("cuda", 20, GIB)))
    lost = node.create_pod(pod_manifest("lost", ("cuda", 30, GIB)))
    api.refuse("PATCH", "/api/v1/namespaces/default/pods/lost")
    kubelet.allocate(lost, "cuda")
    wait_until(lambda: patch_refused(api, "lost"), what="the agent trying to annotate")
    agent.stop(signal.SIGKILL)
    api.allow()
    server.set_delay(SLOW_S)

    restarted = start_agent("2xH100-80GB", kube=cluster.kube)
    restarted.wait_for_log(r"ledger rebuilt from annotations: 1 containers", timeout_s=30)
    port = restarted.metrics_port()
    assert ledger_rows(port) == {("steady", "cuda"): 20}  # blind to "lost" until kubelet answers
    server.set_delay(0)
    wait_until(lambda: ledger_rows(port) == truth_rows(cluster.pod_resources), 20.0, "the ledger completed")
    assert ("lost", "cuda") in ledger_rows(port)
    wait_until(lambda: pod_annotations(api, "lost").get(ASSIGNED) == "true", 10.0, "lost annotated")


# The agent SIGKILLed at each step of an admission. kubelet (the emulator, step by step) goes
# on where it stopped once the agent is back, as kubelet does: it retries the container start,
# so PreStartContainer comes again, then the container starts.
@dataclass(frozen=True)
class KillPoint:
    id: str
    annotated: bool  # the agent's annotation write has landed in the API
    pre_started: bool  # kubelet's PreStartContainer has returned
    running: bool  # the container's process runs (and the duty cycle may freeze it)


KILL_POINTS = [
    KillPoint("allocated-before-annotation", annotated=False, pre_started=False, running=False),
    KillPoint("annotated-before-prestart", annotated=True, pre_started=False, running=False),
    KillPoint("prestarted-before-container", annotated=True, pre_started=True, running=False),
    KillPoint("container-running", annotated=True, pre_started=True, running=True),
]


@pytest.fixture
def rig(short_dir: Path) -> Iterator[EnforcedNode]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    with enforced_node(short_dir, agent_args=("--device-guard", "off", "--no-ioctl-tracing")) as node:
        yield node


def rig_rows(rig: EnforcedNode) -> dict[tuple[str, str], float]:
    port = int(re.findall(r"metrics on http://[^:]+:(\d+)/metrics", rig.agent_log())[-1])
    return ledger_rows(port)


@pytest.mark.privileged
@pytest.mark.parametrize("point", KILL_POINTS, ids=lambda p: p.id)
def test_the_agent_killed_mid_admission_recovers_to_kubelets_truth(
    rig: EnforcedNode, point: KillPoint
) -> None:
    truth = rig.workdir / "pr.sock"
    steady = rig.run_pod("steady", 20)  # a capped neighbour: the duty cycle freezes it again and again
    pod = rig.node.create_pod(enforced_manifest("target", 30, GIB, {}))
    if not point.annotated:  # holds the agent between Allocate's reply and its annotation write
        rig.api.refuse("PATCH", "/api/v1/namespaces/default/pods/target")
    step = rig.kubelet.allocate(pod, "c")
    admission = PodAdmission(pod, [step])
    if point.annotated:
        wait_until(lambda: pod_annotations(rig.api, "target").get(ASSIGNED) == "true", what="the annotations")
    else:
        wait_until(lambda: patch_refused(rig.api, "target"), what="the agent trying to annotate")
    if point.pre_started:
        rig.kubelet.pre_start(step.device_ids)
    boxes = [steady]
    if point.running:
        rig.node.mark_running(pod)
        boxes.append(rig.start_container(admission))
    wait_for(lambda: frozen(steady.cgroup), 10, "the neighbour frozen by its duty cycle")
    # On disk and in the API at the kill: kubelet's record of the IDs, the annotations or not,
    # and a journal naming what is frozen.
    assert truth_rows(truth)[("target", "c")] == 30
    assert (pod_annotations(rig.api, "target").get(ASSIGNED) == "true") is point.annotated
    journal = json.loads((rig.state_dir / "frozen.json").read_text())
    assert str(steady.cgroup) in journal["cgroups"]
    rig.agent.send_signal(signal.SIGKILL)
    rig.agent.wait()
    wait_for(lambda: not any(frozen(b.cgroup) for b in boxes), 2, "the watchdog thawing everything")
    rig.api.allow()

    rig.start_agent()
    # What recovery does: the ledger from pod-resources (both containers, whatever the API has),
    # and the annotations the dead run still owed, re-derived from it.
    assert "ledger rebuilt from pod-resources: 2 containers" in rig.agent_log()
    owed = "re-writing the annotations of 1 pods" in rig.agent_log()
    assert owed is not point.annotated
    if not point.pre_started:  # kubelet's retry of the container start reaches the new agent
        rig.kubelet.pre_start(step.device_ids)
        wait_for(lambda: "30 IDs on GPU 0 confirmed" in rig.agent_log(), 10, "PreStartContainer confirmed")
    if not point.running:
        rig.node.mark_running(pod)
        boxes.append(rig.start_container(admission))
    # The ledger is kubelet's truth: in the metrics, the status and the annotations.
    wait_until(lambda: rig_rows(rig) == truth_rows(truth), 10.0, "the ledger equal to pod-resources")
    wait_until(lambda: pod_annotations(rig.api, "target").get(ASSIGNED) == "true", 10.0, "annotations")
    assert pod_annotations(rig.api, "target")["nvidia.com/predicate-gpu-idx-0"] == "0"
    rig.run_pod("next", 25)  # no double allocation: the next pod gets its own share
    wait_until(lambda: rig_rows(rig) == truth_rows(truth), 10.0, "the next pod recorded")
    assert rig_rows(rig) == {("steady", "c"): 20, ("target", "c"): 30, ("next", "c"): 25}

    def status_gpu() -> tuple[int, list[str]]:
        gpu = fetch_status(rig.state_dir / "status.sock")["gpus"][0]
        return gpu["coresAllocated"], sorted(c["pod"] for c in gpu["containers"])

    # A container's row appears once the control loop has found its processes.
    wait_until(lambda: status_gpu() == (75, ["next", "steady", "target"]), 10.0, "the status")
    # Nothing stuck frozen: every container runs; and the new agent's duty cycle holds the
    # neighbour again (frozen now and then, not for good).
    # (A new agent learns each container's drains again: one can wait frozen a few seconds
    # between turns while it does, so each is given 15 s to show 0.15 s of GPU work.)
    before = rig.gpu_seconds(boxes)
    wait_for(
        lambda: all(now - then >= 0.15 for now, then in zip(rig.gpu_seconds(boxes), before, strict=True)),
        15,
        "every container running",
    )
    wait_for(lambda: frozen(steady.cgroup), 10, "the neighbour throttled by the new agent")
    wait_for(lambda: not frozen(steady.cgroup), 10, "the neighbour running again")
