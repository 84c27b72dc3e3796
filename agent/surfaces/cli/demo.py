"""``vcuda-agent demo``: a simulated GPU node at work, in two acts, the first with the device
plugin against an emulated API server and kubelet, the second live over real container
cgroups (what each act shows: :data:`.simcommands.DEMO_DESCRIPTION`, its ``--help``)."""

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
from typing import Any

from rich.console import Console

from agent.domain.ids import decode
from agent.emulators.apiserver import FakeApiServer
from agent.emulators.cluster import EmulatedNode
from agent.emulators.kubelet import AdmissionError, KubeletEmulator, PluginConnection
from agent.emulators.pods import load_manifests, pod_from_manifest
from agent.emulators.simnode import sim_agent_command
from agent.errors import VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.surfaces.cli import demo_live
from agent.surfaces.cli.demo_view import NODE, ClusterView, ledger_lines, section

EXAMPLE_PODS = Path(__file__).with_name("demo_pods.yaml")


def main(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vcuda-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)  # --workdir may name a directory not made yet
    # The first Ctrl-C (or SIGTERM) unwinds through every clean-up; later ones must not cut it short.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt_once)
    try:
        if not args.no_intro:
            code = Demo(workdir, args.simulate).run()
            if code:
                return code
        console = Console(highlight=False, width=None if sys.stdout.isatty() else demo_live.LOG_WIDTH)
        demo_live.run(workdir / "live", args.duration, args.metrics_address, console)
    except KeyboardInterrupt:
        print("\ninterrupted: agents, workloads and their cgroups removed, nothing left frozen")
        return 130
    except (VcudaError, TimeoutError) as err:
        print(f"\ndemo failed: {err}\n(agent logs in {workdir})", file=sys.stderr)
        return 1
    print(f"\ndemo finished; agent logs in {workdir}")
    return 0


def _interrupt_once(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Demo:
    def __init__(self, workdir: Path, spec: str) -> None:
        self.workdir = workdir
        self.spec = spec
        self.plugin_dir = workdir / "device-plugins"
        self.sim = SimNodeDir(workdir / "sim")
        self.port = _free_port()
        self.pod_resources = workdir / "pod-resources.sock"
        self.kubelet = KubeletEmulator(self.plugin_dir, pod_resources_socket=self.pod_resources)
        self.api = FakeApiServer()
        self.node = EmulatedNode(self.api, self.kubelet, NODE)
        self.view = ClusterView(self.api, NODE)

    def run(self) -> int:
        print(f"vcuda-agent demo: simulated node {self.spec}; files in {self.workdir}")
        self.api.start()
        self.api.create_node(NODE, labels={"nvidia-device-enable": "enable"})
        kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig")
        print(f"emulated kube-apiserver at {self.api.url} (kubeconfig {kubeconfig})")
        self.kubelet.start()
        try:
            with self._agent(kubeconfig) as first:
                plugin = self._registration()
                self.view.node_summary()
                self._admissions(plugin)
                self._fault(plugin)
                self._kubelet_restart()
                code = self._stop(self._crash_and_recover(first, kubeconfig))
        finally:
            self.kubelet.stop()
            self.api.stop()
        return code

    @contextlib.contextmanager
    def _agent(self, kubeconfig: Path) -> Iterator[subprocess.Popen[bytes]]:
        section("starting the agent")
        self._spawn(kubeconfig, show=True)
        try:
            yield self._proc
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._log.close()

    def _spawn(self, kubeconfig: Path, show: bool = False) -> subprocess.Popen[bytes]:
        cmd = sim_agent_command(
            self.spec,
            self.plugin_dir,
            self.sim.root,
            node_name=NODE,
            metrics_address=f"127.0.0.1:{self.port}",
            kube=(kubeconfig, self.pod_resources),
        )
        if show:
            print("$ vcuda-agent " + " ".join(cmd[3:]))
        self._log = (self.workdir / "agent.log").open("ab")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        return self._proc

    def _crash_and_recover(self, agent: subprocess.Popen[bytes], kubeconfig: Path) -> subprocess.Popen[bytes]:
        section("agent crash (SIGKILL) and restart")
        before = self._http("/metrics")
        agent.kill()
        agent.wait()
        self._log.close()
        count = len(self.kubelet.registrations)
        started = time.monotonic()
        agent = self._spawn(kubeconfig)
        if not self.kubelet.wait_for(lambda: len(self.kubelet.registrations) > count, 60):
            raise AdmissionError("the restarted agent did not register within 60 s")
        elapsed = time.monotonic() - started
        after = self._http("/metrics")
        rebuilt = [
            line for line in (self.workdir / "agent.log").read_text().splitlines() if "ledger rebuilt" in line
        ]
        print(f"registered again {elapsed:.1f} s after the restart; {rebuilt[-1].split(': ', 1)[-1]}")
        same = ledger_lines(before) == ledger_lines(after)
        print(f"ledger after restart equals the ledger before the crash: {same}")
        if not same:
            raise AdmissionError("the rebuilt ledger differs from the one before the crash")
        return agent

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
                f"NUMA node {sorted(numa[index])}, NVML sample period {node.gpu(index).sample_period_s:.3f} s"
            )
        print(f"  example ID: {sorted(plugin.devices)[0]}")
        print(f"/readyz: {self._http('/readyz')}")
        return plugin

    def _admissions(self, plugin: PluginConnection) -> None:
        manifests = {m["metadata"]["name"]: m for m in load_manifests(EXAMPLE_PODS)}
        section("admitting the example pods")
        self._admit(manifests["cuda-share-50"])
        self._admit(manifests["cuda-exclusive-200"])
        print("  -> deleting default/cuda-share-50 to free GPU 0")
        self.node.delete_pod("default", "cuda-share-50")
        self.node.delete_pod("default", "cuda-exclusive-200")
        self._admit(manifests["cuda-exclusive-200"])
        print("  -> deleting default/cuda-exclusive-200")
        self.node.delete_pod("default", "cuda-exclusive-200")
        self._admit(manifests["cuda-invalid-150"])
        self.node.delete_pod("default", "cuda-invalid-150")
        self._admit(manifests["cuda-share-50"])
        self._admit(manifests["cuda-bad-limit"])
        self.view.pod_summary(["cuda-share-50", "cuda-bad-limit"], self._http("/metrics"))

    def _admit(self, manifest: dict[str, Any]) -> None:
        pod = pod_from_manifest(manifest)
        requests = ", ".join(
            f"{c.name}: vcuda-core={c.cores} vcuda-memory={c.memory_mib}" for c in pod.containers
        )
        print(f"\npod {pod.key} ({requests})")
        try:
            admission = self.node.run_pod(manifest)
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
        section("GPU fault: XID 79 on GPU 1")
        before = len(plugin.updates)
        capacity = self.view.capacity()
        started = time.monotonic()
        post_event(self.sim.root, 1, EventKind.XID.value, xid=79, detail="demo")
        if not self.kubelet.wait_for(lambda: len(plugin.updates) > before, 5):
            raise AdmissionError("ListAndWatch sent no update within 5 s of the XID")
        unhealthy = sum(1 for d in plugin.devices.values() if d.health != "Healthy")
        elapsed_ms = (time.monotonic() - started) * 1000
        print(f"ListAndWatch update after {elapsed_ms:.0f} ms: {unhealthy} IDs Unhealthy")
        self.view.capacity_after_fault(capacity)

    def _kubelet_restart(self) -> None:
        section("kubelet restart")
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
        section("stopping the agent (SIGTERM)")
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
