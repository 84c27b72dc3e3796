"""A whole simulated GPU node with real containers, for enforcement tests, benches and demos.

It runs the fake API server and the kubelet emulator (with pod-resources) in this process;
the node's GPU server (``vcuda-agent sim-gpu``: the simulated GPUs and their driver) as a
child process outside every container, so freezing a workload never freezes its GPU and
the GPUs outlive agent restarts; a real ``vcuda-agent run`` in Kubernetes mode as a child
process whose cgroup root is a fresh directory in this machine's cgroup v2 hierarchy; and
the container runtime emulator, which starts each admitted pod's workload (a
``vcuda-agent sim-workload`` process) inside its own container cgroup there. The agent
measures the workloads through the simulated GPUs' NVML-style samples and freezes their
real cgroups, exactly as on a node. Needs root and a cgroup v2 hierarchy (hybrid nodes have
one).

What a workload really got of its GPU is the GPU server's ground truth (``gpu_seconds``,
``utilization``), exact to the instant it is asked, not what the late samples said.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.cluster import EmulatedNode, container_id
from agent.emulators.containers import ContainerRuntime, RunningContainer
from agent.emulators.kubelet import KubeletEmulator, PodAdmission
from agent.emulators.simnode import sim_agent_command
from agent.errors import PlatformError, SimulationError
from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.paths import QosClass
from agent.platform.cgroups.tree import remove_tree
from agent.platform.gpu.sim.client import NodeClient, context_times
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.mpsdaemon import stop_recorded_daemons

NODE = "sim-node"
# The emulated admin lets pods pick every policy and any limit (the product's default bounds
# are narrower: docs/security.md); tests of the bounds start the agent with their own config.
PERMISSIVE_NODE = {
    "name": NODE,
    "allowedPolicies": ["fixed-share", "burst-share", "best-effort"],
    "maxLimitRatio": 100,
}


def frozen(cgroup: Path) -> bool:
    """Frozen, or asked to freeze (v2)."""
    events = dict(line.split() for line in (cgroup / "cgroup.events").read_text().splitlines())
    return events.get("frozen") == "1" or (cgroup / "cgroup.freeze").read_text().strip() == "1"


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def frozen_then_thawed(cgroup: Path, timeout_s: float, what: str) -> None:
    """Wait until ``cgroup`` is seen frozen and then thawed again: held by the agent's freezes
    (in turns or duty cycles), not frozen for good."""
    wait_for(lambda: frozen(cgroup), timeout_s, f"{what} frozen")
    wait_for(lambda: not frozen(cgroup), timeout_s, f"{what} thawed again")


def never_frozen(cgroup: Path, seconds: float) -> bool:
    """Whether ``cgroup`` stays unfrozen over the next ``seconds`` (polled every 10 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if frozen(cgroup):
            return False
        time.sleep(0.01)
    return True


def pod_manifest(
    name: str,
    cores: int,
    memory_mib: int | None,
    annotations: Mapping[str, str],
    security: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``security``: the container's securityContext (None: none, as most pods)."""
    limits = {"nvidia.com/vcuda-core": str(cores)}
    if memory_mib is not None:
        limits["nvidia.com/vcuda-memory"] = str(memory_mib)
    container: dict[str, Any] = {"name": "c", "image": "cuda", "resources": {"limits": limits}}
    if security is not None:
        container["securityContext"] = dict(security)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(annotations)},
        "spec": {"containers": [container]},
    }


@dataclass
class EnforcedNode:
    workdir: Path
    api: FakeApiServer
    kubelet: KubeletEmulator
    node: EmulatedNode
    runtime: ContainerRuntime
    cgroup_root: Path
    spec: str | None  # None: real GPUs (NVML)
    agent_args: tuple[str, ...]
    gpu_server: subprocess.Popen[bytes] | None = None
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    responses: dict[str, Any] = field(default_factory=dict)  # pod name -> its Allocate response

    @property
    def agent(self) -> subprocess.Popen[bytes]:
        return self.agents[-1]

    @property
    def state_dir(self) -> Path:
        return self.workdir / "agent-state"

    def start_agent(self, *extra: str) -> subprocess.Popen[bytes]:
        """Start (or restart) the agent; returns once kubelet has its plugin registered."""
        kube = (self.workdir / "kubeconfig", self.workdir / "pr.sock")
        cmd = sim_agent_command(
            self.spec,
            self.workdir / "dp",
            self.workdir / "sim",
            node_name=NODE,
            kube=kube,
            extra=self.agent_args + extra,
        )
        registered = len(self.kubelet.registrations)  # a restart: wait for the new agent's
        with (self.workdir / f"agent-{len(self.agents)}.log").open("wb") as log:
            agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.agents.append(agent)
        deadline = time.monotonic() + 60
        while not self.kubelet.wait_for(lambda: self._plugin_ready(registered), 0.2):
            if agent.poll() is not None:
                tail = "\n".join(self.agent_log().splitlines()[-5:])
                raise PlatformError(f"the agent exited with {agent.returncode} before registering:\n{tail}")
            if time.monotonic() > deadline:
                raise PlatformError("the agent did not register with kubelet within 60 s")
        return agent

    def metrics(self) -> str:
        """The current agent's /metrics text."""
        found = wait_for(
            lambda: re.search(r"metrics on (http://\S+/metrics)", self.agent_log()), 10, "metrics"
        )
        with urllib.request.urlopen(found.group(1), timeout=5) as answer:
            return str(answer.read().decode())

    def _plugin_ready(self, registered: int) -> bool:
        """kubelet has connected to a plugin registered after the first ``registered`` and
        has its device list."""
        plugin = self.kubelet.plugins.get("nvidia.com/vcuda-core")
        if plugin is None or not plugin.updates:
            return False
        # By identity: the registrations of two runs of the agent are equal messages.
        return any(plugin.request is r for r in self.kubelet.registrations[registered:])

    def agent_log(self) -> str:
        return (self.workdir / f"agent-{len(self.agents) - 1}.log").read_text(errors="replace")

    def run_pod(
        self,
        name: str,
        cores: int,
        *,
        memory_mib: int = 1024,
        busy: float = 1.0,
        annotations: Mapping[str, str] | None = None,
        workload_mib: int = 0,
        extra: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        security: Mapping[str, Any] | None = None,
    ) -> RunningContainer:
        """Create and admit the pod (Allocate over real gRPC), start its container, and wait
        until its workload runs (a capped container's start-up runs throttled too). ``env``:
        the container spec's own env, which wins over Allocate's, as kubelet merges them;
        ``security``: the container's securityContext in the pod spec (its process runs as
        root here whatever that says)."""
        memory = memory_mib if cores < 100 else None
        manifest = pod_manifest(name, cores, memory, annotations or {}, security)
        admission = self.node.run_pod(manifest)
        return self.start_container(admission, busy=busy, workload_mib=workload_mib, extra=extra, env=env)

    def start_container(
        self,
        admission: PodAdmission,
        *,
        busy: float = 1.0,
        workload_mib: int = 0,
        extra: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        user: int | None = None,
        command: Sequence[str] | None = None,
        wait: bool = True,
    ) -> RunningContainer:
        """Start an admitted one-container pod's container with what Allocate handed out (and
        its own ``env`` over it), as ``user`` (None: root), running ``command`` (None: a
        simulated workload), and (``wait``) wait until its workload runs on its GPU."""
        name = admission.pod.name
        pod = self.api.pod("default", name)
        assert pod is not None
        response = admission.containers[0].response
        self.responses[name] = response
        envs = response.envs
        box = self.runtime.start(
            f"default/{name}/c",
            pod_uid=admission.pod.uid,
            qos=QosClass(pod["status"]["qosClass"]),
            container_id=container_id(admission.pod.uid, "c"),
            gpu=self.gpu_index(envs["VCUDA_GPU_UUIDS"].split(",")[0]),
            busy=busy,
            memory_mib=workload_mib,
            extra=extra,
            envs={**dict(envs), **(env or {})},
            mounts=[(m.container_path, m.host_path) for m in response.mounts],
            user=user,
            command=command,
        )
        if not wait:
            return box
        wait_for(lambda: self.on_gpu(box) or box.proc.poll() is not None, 30, f"{name}'s workload on its GPU")
        if box.proc.poll() is not None:
            raise PlatformError(
                f"the workload of {name} exited with {box.proc.returncode} before reaching its GPU"
            )
        return box

    def gpu_index(self, uuid: str) -> int:
        node = SimNodeDir(self.runtime.sim_state_dir).read_node()
        return next(slot.index for slot in node.gpus if slot.uuid == uuid)

    def truth(self) -> dict[str, Any]:
        """The GPU server's ground truth (``truth`` in :mod:`agent.platform.gpu.sim.protocol`)."""
        client = NodeClient(SimNodeDir(self.runtime.sim_state_dir).socket)
        try:
            return client.truth()
        finally:
            client.close()

    def gpu_seconds(self, containers: Sequence[RunningContainer]) -> list[float]:
        """GPU seconds each container's workload has run so far (0 once it exited)."""
        ran = context_times(self.truth())
        return [ran.get(c.pid, 0.0) for c in containers]

    def utilization(self, containers: Sequence[RunningContainer], seconds: float) -> list[float]:
        """Percent of its GPU each container really got over the next ``seconds``."""
        before = self.gpu_seconds(containers)
        started = time.monotonic()
        time.sleep(seconds)
        after = self.gpu_seconds(containers)
        elapsed = time.monotonic() - started
        return [100 * (a - b) / elapsed for a, b in zip(after, before, strict=True)]

    def on_gpu(self, box: RunningContainer) -> bool:
        """The workload has its context on the GPU."""
        return box.pid in context_times(self.truth())

    def stop_agent(self, signum: int = signal.SIGTERM) -> int:
        self.agent.send_signal(signum)
        return self.agent.wait(timeout=20)


def start_gpu_server(
    spec: str, sim_dir: Path, log_path: Path, gpu_args: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """``vcuda-agent sim-gpu`` for the node, returned once its socket answers."""
    cmd = [sys.executable, "-m", "agent", "sim-gpu", "--simulate", spec, "--node-name", NODE]
    cmd += ["--sim-state-dir", str(sim_dir), *gpu_args]
    with log_path.open("wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    root = SimNodeDir(sim_dir)

    def ready() -> bool:
        if server.poll() is not None:
            raise PlatformError(
                f"the GPU server exited with {server.returncode}: {log_path.read_text()[-500:]}"
            )
        try:
            return root.read_node().server_pid == server.pid
        except SimulationError:
            return False

    wait_for(ready, 30, "the simulated GPU server")
    return server


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exit_on_sigterm() -> None:
    """A script's SIGTERM (``timeout``, ``kill``) raises SystemExit, so that ``enforced_node``
    stops its agent, GPU server and workloads and removes their cgroups; by default Python
    dies on the spot and leaves them all running. For the main thread of a bench script."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


@contextlib.contextmanager
def enforced_node(
    workdir: Path,
    spec: str | None = "1xH100-80GB",
    *,
    gpu_args: tuple[str, ...] = (),
    agent_args: tuple[str, ...] = (),
) -> Iterator[EnforcedNode]:
    """The node, its GPU server and agent started; everything stopped and removed on exit.
    ``spec`` None: the machine's real GPUs through NVML (bench/gpu_enforcement.py).
    ``gpu_args``: options of ``vcuda-agent sim-gpu`` (sample period, timeslice, MPS...)."""
    layout = detect_layout()
    if layout.v2_root is None:
        raise PlatformError("the enforced simulated node needs a cgroup v2 hierarchy (pure v2 or hybrid)")
    root = layout.v2_root / f"vcuda-sim-{secrets.token_hex(4)}"
    root.mkdir()
    workdir.mkdir(parents=True, exist_ok=True)
    kubelet_config = workdir / "kubelet-config.yaml"
    kubelet_config.write_text("cgroupDriver: cgroupfs\n")
    node_config = workdir / "node-config.json"
    node_config.write_text(json.dumps({"nodeConfig": [PERMISSIVE_NODE]}))
    args: tuple[str, ...] = ("--cgroup-root", str(root), "--kubelet-config", str(kubelet_config))
    args += ("--config", str(node_config))
    api = FakeApiServer(bookmark_interval_s=0.5)
    api.start()
    api.create_node(NODE, labels={"nvidia-device-enable": "enable"})
    api.write_kubeconfig(workdir / "kubeconfig")
    kubelet = KubeletEmulator(workdir / "dp", pod_resources_socket=workdir / "pr.sock")
    kubelet.start()
    runtime = ContainerRuntime(root, workdir / "sim")
    node = EnforcedNode(
        workdir, api, kubelet, EmulatedNode(api, kubelet, NODE), runtime, root, spec, args + agent_args
    )
    try:
        if spec is not None:
            node.gpu_server = start_gpu_server(spec, workdir / "sim", workdir / "gpu.log", gpu_args)
        node.start_agent()
        yield node
    finally:
        for agent in node.agents:
            stop_process(agent)
        runtime.stop()
        # The agent leaves its MPS daemons running, by design; after the workloads (their
        # clients would fail with an MPS RPC error if their server went first).
        stop_recorded_daemons(workdir / "mps")
        if node.gpu_server is not None:
            stop_process(node.gpu_server)
        kubelet.stop()
        api.stop()
        remove_tree(root)
