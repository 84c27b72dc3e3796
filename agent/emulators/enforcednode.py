"""A whole simulated GPU node with real containers, for enforcement tests, benches and demos.

It runs the fake API server and the kubelet emulator (with pod-resources) in this process,
a real ``vcuda-agent run`` in Kubernetes mode as a child process whose cgroup root is a
fresh directory in this machine's cgroup v2 hierarchy, and the container runtime emulator,
which starts each admitted pod's workload inside its own container cgroup there. The agent
measures the workloads through the simulated GPU and freezes their real cgroups, exactly
as on a node. Needs root and a cgroup v2 hierarchy (hybrid nodes have one).

What a workload really got of its GPU (its CPU core) can be read from its CPU time in
/proc (``utilization``): the quantity the simulated GPU reports to the agent.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.cluster import EmulatedNode, container_id
from agent.emulators.containers import ContainerRuntime, RunningContainer
from agent.emulators.kubelet import KubeletEmulator
from agent.emulators.simnode import sim_agent_command
from agent.errors import PlatformError
from agent.platform.cgroups.layout import detect_layout
from agent.platform.cgroups.paths import QosClass
from agent.platform.gpu.simstate import SimStateDir
from agent.platform.procfs import ProcFS

HZ = os.sysconf("SC_CLK_TCK")
NODE = "sim-node"


def cpu_seconds(pid: int) -> float:
    return ProcFS().stat(pid).cpu_ticks / HZ


def utilization(containers: list[RunningContainer], seconds: float) -> list[float]:
    """Percent of one core each container used over the next ``seconds``."""
    before = [cpu_seconds(c.pid) for c in containers]
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return [100 * (cpu_seconds(c.pid) - b) / elapsed for c, b in zip(containers, before, strict=True)]


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


def pod_manifest(
    name: str, cores: int, memory_mib: int | None, annotations: Mapping[str, str]
) -> dict[str, Any]:
    limits = {"nvidia.com/vcuda-core": str(cores)}
    if memory_mib is not None:
        limits["nvidia.com/vcuda-memory"] = str(memory_mib)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(annotations)},
        "spec": {"containers": [{"name": "c", "image": "cuda", "resources": {"limits": limits}}]},
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
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)

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
        with (self.workdir / f"agent-{len(self.agents)}.log").open("wb") as log:
            agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.agents.append(agent)
        deadline = time.monotonic() + 60
        while not self.kubelet.wait_for(lambda: bool(self._plugin_ready()), 0.2):
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

    def _plugin_ready(self) -> bool:
        plugin = self.kubelet.plugins.get("nvidia.com/vcuda-core")
        return plugin is not None and bool(plugin.updates)

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
    ) -> RunningContainer:
        """Create and admit the pod (Allocate over real gRPC), start its container, and wait
        until its workload runs (a capped container's start-up runs throttled too)."""
        manifest = pod_manifest(name, cores, memory_mib if cores < 100 else None, annotations or {})
        admission = self.node.run_pod(manifest)
        pod = self.api.pod("default", name)
        assert pod is not None
        envs = admission.containers[0].response.envs
        box = self.runtime.start(
            f"default/{name}/c",
            pod_uid=admission.pod.uid,
            qos=QosClass(pod["status"]["qosClass"]),
            container_id=container_id(admission.pod.uid, "c"),
            gpu=self.gpu_index(envs["VCUDA_GPU_UUIDS"].split(",")[0]),
            busy=busy,
            memory_mib=workload_mib,
            extra=extra,
        )
        record = self.runtime.sim_state_dir / "procs" / f"{box.pid}.json"
        wait_for(record.exists, 30, f"the workload of {name} registered with the simulated GPU")
        return box

    def gpu_index(self, uuid: str) -> int:
        node = SimStateDir(self.runtime.sim_state_dir).read_node()
        return next(slot.index for slot in node.gpus if slot.uuid == uuid)

    def stop_agent(self, signum: int = signal.SIGTERM) -> int:
        self.agent.send_signal(signum)
        return self.agent.wait(timeout=20)


@contextlib.contextmanager
def enforced_node(
    workdir: Path, spec: str | None = "1xH100-80GB", *, sim_cores: str = "1", agent_args: tuple[str, ...] = ()
) -> Iterator[EnforcedNode]:
    """The node, its agent started; everything stopped and removed on exit. ``spec`` None:
    the machine's real GPUs through NVML (bench/gpu_enforcement.py). ``sim_cores``: the CPU
    cores backing simulated GPUs (on a 2-core machine keep core 0 for the agent)."""
    layout = detect_layout()
    if layout.v2_root is None:
        raise PlatformError("the enforced simulated node needs a cgroup v2 hierarchy (pure v2 or hybrid)")
    root = layout.v2_root / f"vcuda-sim-{secrets.token_hex(4)}"
    root.mkdir()
    workdir.mkdir(parents=True, exist_ok=True)
    kubelet_config = workdir / "kubelet-config.yaml"
    kubelet_config.write_text("cgroupDriver: cgroupfs\n")
    args: tuple[str, ...] = ("--cgroup-root", str(root), "--kubelet-config", str(kubelet_config))
    if spec is not None:
        args += ("--sim-cores", sim_cores)
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
        node.start_agent()
        yield node
    finally:
        for agent in node.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                try:
                    agent.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
        runtime.stop()
        kubelet.stop()
        api.stop()
        for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                path.rmdir()
        root.rmdir()
