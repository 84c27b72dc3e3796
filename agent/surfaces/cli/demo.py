"""A simulated GPU node at work: starts `vcuda-agent run --simulate` as a real process,
an emulated kubelet that admits the example pods over the real device plugin API,
then injects a GPU fault and a kubelet restart, and stops the agent with SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from agent.domain.ids import decode
from agent.emulators.kubelet import AdmissionError, KubeletEmulator, PluginConnection
from agent.emulators.pods import PodSpec, load_pods
from agent.emulators.simnode import sim_agent_command
from agent.errors import VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.simstate import SimStateDir

EXAMPLE_PODS = Path(__file__).with_name("demo_pods.yaml")


def main(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vcuda-demo-"))
    try:
        return Demo(workdir, args.simulate).run()
    except VcudaError as err:
        print(f"\ndemo failed: {err}\n(agent log: {workdir / 'agent.log'})", file=sys.stderr)
        return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


class Demo:
    def __init__(self, workdir: Path, spec: str) -> None:
        self.workdir = workdir
        self.spec = spec
        self.plugin_dir = workdir / "device-plugins"
        self.sim = SimStateDir(workdir / "sim")
        self.port = _free_port()
        self.kubelet = KubeletEmulator(self.plugin_dir)

    def run(self) -> int:
        print(f"vcuda-agent demo: simulated node {self.spec}; files in {self.workdir}")
        self.kubelet.start()
        try:
            with self._agent() as agent:
                plugin = self._registration()
                self._admissions(plugin)
                self._fault(plugin)
                self._kubelet_restart()
                code = self._stop(agent)
        finally:
            self.kubelet.stop()
        return code

    @contextlib.contextmanager
    def _agent(self) -> Iterator[subprocess.Popen[bytes]]:
        cmd = sim_agent_command(
            self.spec,
            self.plugin_dir,
            self.sim.root,
            node_name="demo-node",
            metrics_address=f"127.0.0.1:{self.port}",
        )
        _section("starting the agent")
        print("$ vcuda-agent " + " ".join(cmd[3:]))
        log = (self.workdir / "agent.log").open("wb")
        agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield agent
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()

    def _registration(self) -> PluginConnection:
        plugin = self.kubelet.wait_for_plugin(timeout_s=30)
        req = plugin.request
        print(
            f"registered: resource={req.resource_name} endpoint={req.endpoint} version={req.version} "
            f"pre_start_required={req.options.pre_start_required} "
            f"get_preferred_allocation_available={req.options.get_preferred_allocation_available}"
        )
        node = self.sim.read_node()
        uuids = {slot.uuid: slot.index for slot in node.gpus}
        per_gpu: dict[int, list[str]] = {}
        numa: dict[int, set[int]] = {}
        for device in plugin.devices.values():
            index = uuids[decode(device.ID).gpu_uuid]
            per_gpu.setdefault(index, []).append(device.health)
            numa.setdefault(index, set()).update(n.ID for n in device.topology.nodes)
        for index, health in sorted(per_gpu.items()):
            print(
                f"  GPU {index}: {len(health)} device IDs, {health.count('Healthy')} Healthy, "
                f"NUMA node {sorted(numa[index])}, simulated on CPU core {node.core_of(index)}"
            )
        print(f"  example ID: {sorted(plugin.devices)[0]}")
        print(f"/readyz: {self._http('/readyz')}")
        return plugin

    def _admissions(self, plugin: PluginConnection) -> None:
        pods = {p.name: p for p in load_pods(EXAMPLE_PODS)}
        _section("admitting the example pods")
        share, exclusive = pods["cuda-share-50"], pods["cuda-exclusive-200"]
        self._admit(share)
        self._admit(exclusive)
        print(f"  -> deleting {share.key} to free GPU 0")
        self.kubelet.release(share)
        self._admit(exclusive)
        print(f"  -> deleting {exclusive.key}")
        self.kubelet.release(exclusive)
        self._admit(pods["cuda-invalid-150"])
        self._admit(share)

    def _admit(self, pod: PodSpec) -> None:
        requests = ", ".join(
            f"{c.name}: vcuda-core={c.cores} vcuda-memory={c.memory_mib}" for c in pod.containers
        )
        print(f"\npod {pod.key} ({requests})")
        try:
            admission = self.kubelet.admit(pod)
        except AdmissionError as err:
            print(f"  refused: {err}")
            return
        uuids = {slot.uuid: slot.index for slot in self.sim.read_node().gpus}
        for c in admission.containers:
            gpus = sorted({uuids[decode(i).gpu_uuid] for i in c.device_ids})
            envs = dict(c.response.envs)
            print(f"  {c.container}: {len(c.device_ids)} IDs on GPU {gpus}")
            print(f"    devices: {', '.join(d.container_path for d in c.response.devices)}")
            print(
                f"    env: VCUDA_CORE={envs.get('VCUDA_CORE')} "
                f"NVIDIA_VISIBLE_DEVICES={envs.get('NVIDIA_VISIBLE_DEVICES')}"
            )
            print(f"    driver mounts: {len(c.response.mounts)} (none on a node without an NVIDIA driver)")

    def _fault(self, plugin: PluginConnection) -> None:
        _section("GPU fault: XID 79 on GPU 1")
        before = len(plugin.updates)
        started = time.monotonic()
        self.sim.post_event(1, EventKind.XID, xid=79, detail="demo")
        if not self.kubelet.wait_for(lambda: len(plugin.updates) > before, 5):
            raise AdmissionError("ListAndWatch sent no update within 5 s of the XID")
        unhealthy = sum(1 for d in plugin.devices.values() if d.health != "Healthy")
        elapsed_ms = (time.monotonic() - started) * 1000
        print(f"ListAndWatch update after {elapsed_ms:.0f} ms: {unhealthy} IDs Unhealthy")

    def _kubelet_restart(self) -> None:
        _section("kubelet restart")
        count = len(self.kubelet.registrations)
        started = time.monotonic()
        self.kubelet.restart()
        if not self.kubelet.wait_for(lambda: len(self.kubelet.registrations) > count, 5):
            raise AdmissionError("the agent did not register again within 5 s of the kubelet restart")
        plugin = self.kubelet.wait_for_plugin(timeout_s=5)
        elapsed_ms = (time.monotonic() - started) * 1000
        print(
            f"re-registered {elapsed_ms:.0f} ms after kubelet re-created kubelet.sock; "
            f"ListAndWatch sent {len(plugin.devices)} devices"
        )

    def _stop(self, agent: subprocess.Popen[bytes]) -> int:
        _section("stopping the agent (SIGTERM)")
        metrics = [
            line for line in self._http("/metrics").splitlines() if line.startswith("vcuda_gpu_healthy")
        ]
        print("metrics:\n  " + "\n  ".join(metrics))
        self.kubelet.stop()  # as a node drain would: kubelet lets go of the plugin first
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=15)
        socket_left = (self.plugin_dir / "vcuda-core.sock").exists()
        print(f"agent exited with {code}; plugin socket removed: {not socket_left}")
        print(f"\nagent log: {self.workdir / 'agent.log'}")
        return 0 if code == 0 and not socket_left else 1

    def _http(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return str(response.read().decode().strip())
        except urllib.error.HTTPError as err:
            return f"{err.code} {err.read().decode().strip()}"
        except OSError as err:
            return f"unreachable ({err})"
