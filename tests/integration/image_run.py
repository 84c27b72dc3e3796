"""The agent's image run the way deploy/base/daemonset.yaml runs it, with podman: the pod's
host namespaces, privileges, volumes (hostPath at its host path, or a stand-in directory
given by volume name), env and args become `podman run` options. Used by
tests/integration/test_image_run.py, which builds the image with `make image`'s script."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.surfaces.statusclient import StatusUnavailableError, fetch_status
from tests.integration.deploy_render import ROOT, container, load_yaml
from tests.integration.prometheus import free_port

BUILD_SCRIPT = ROOT / "deploy/image/build.sh"
PODMAN_GLOBAL = ("--cgroup-manager=cgroupfs", "--events-backend=file")
# podman's default RLIMIT_NOFILE (1048576) and RLIMIT_NPROC are refused where the engine
# lacks CAP_SYS_RESOURCE (this VM's root): what the caller has, and podman's usual NPROC.
NPROC = 32768

Doc = dict[str, Any]


def daemonset() -> Doc:
    [found] = [d for d in load_yaml("deploy/base/daemonset.yaml") if d["kind"] == "DaemonSet"]
    return found


def image_name(ds: Doc) -> str:
    image: str = container(ds)["image"]
    return image


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["podman", *PODMAN_GLOBAL, *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return out


def ulimits() -> list[str]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={NPROC}:{NPROC}"]


@dataclass
class PodSpec:
    """What the DaemonSet's pod template asks of the runtime, as `podman run` options."""

    options: list[str]
    args: list[str]
    env: dict[str, str]


def pod_spec(
    ds: Doc,
    stand_ins: Mapping[str, Path],
    field_values: Mapping[str, str],
) -> PodSpec:
    """``stand_ins``: volume name -> host directory used instead of its hostPath (a ConfigMap
    volume must have one). ``field_values``: fieldRef path -> value (spec.nodeName...)."""
    pod = ds["spec"]["template"]["spec"]
    agent = container(ds)
    options: list[str] = []
    if agent.get("securityContext", {}).get("privileged"):
        options.append("--privileged")
    for cap in agent.get("securityContext", {}).get("capabilities", {}).get("add", []):
        options += ["--cap-add", cap]
    if pod.get("hostPID"):
        options.append("--pid=host")
    if pod.get("hostNetwork"):
        options.append("--network=host")
    volumes = {v["name"]: v for v in pod["volumes"]}
    spec = PodSpec(options, list(agent.get("args", [])), {})
    for mount in agent.get("volumeMounts", []):
        name = mount["name"]
        volume = volumes[name]
        host_path = volume.get("hostPath")
        if name in stand_ins:
            host = stand_ins[name]
        elif host_path is not None:
            host = Path(host_path["path"])
        else:
            raise AssertionError(f"volume {name} is not a hostPath: the run needs a stand-in for it")
        if host_path is not None and host_path.get("type") == "DirectoryOrCreate":
            host.mkdir(parents=True, exist_ok=True)
        if not host.is_dir():
            raise AssertionError(f"volume {name}: {host} is not a directory on this host")
        modes = ["ro"] if mount.get("readOnly") else []
        propagation = mount.get("mountPropagation", "None")
        modes += {"None": [], "HostToContainer": ["rslave"], "Bidirectional": ["rshared"]}[propagation]
        suffix = ":" + ",".join(modes) if modes else ""
        options += ["-v", f"{host}:{mount['mountPath']}{suffix}"]
    for env in agent.get("env", []):
        if "value" in env:
            spec.env[env["name"]] = env["value"]
        else:
            spec.env[env["name"]] = field_values[env["valueFrom"]["fieldRef"]["fieldPath"]]
    for key, value in spec.env.items():
        options += ["-e", f"{key}={value}"]
    return spec


def config_dir(directory: Path) -> Path:
    """The ConfigMap gpu-manager-config as kubelet projects it: its one file, config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "deploy/base/config.json", directory / "config.json")
    return directory


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


@dataclass
class RunningAgent:
    name: str
    port: int
    state_dir: Path

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return (out.stdout + out.stderr)[-6000:]

    def running(self) -> bool:
        out = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return out.stdout.strip() == "true"

    def metrics(self) -> str:
        code, body = http_get(self.port, "/metrics")
        return body if code == 200 else ""

    def bpf_status(self) -> str:
        """The ``vcuda_bpf_status`` state that is 1, or '' while none is (or no answer)."""
        for line in self.metrics().splitlines():
            if line.startswith("vcuda_bpf_status{") and line.endswith(" 1.0"):
                return line.split('status="', 1)[1].split('"', 1)[0]
        return ""

    def status(self) -> dict[str, Any]:
        return fetch_status(self.state_dir / "status.sock")

    def stop(self, timeout_s: int = 20) -> int:
        podman("stop", "-t", str(timeout_s), self.name, timeout=timeout_s + 30)
        out = podman("inspect", "--format", "{{.State.ExitCode}}", self.name)
        return int(out.stdout.strip())


@contextlib.contextmanager
def agent_container(
    spec: PodSpec, image: str, state_dir: Path, extra_args: tuple[str, ...], name: str
) -> Iterator[RunningAgent]:
    """``podman run -d`` of the image with the pod's options, its args plus ``extra_args``
    (a free metrics port is added); always removed on exit."""
    port = free_port()
    runc = shutil.which("runc")
    assert runc is not None
    podman("rm", "-f", "-t", "0", name, check=False)
    cmd = ["run", "-d", "--name", name, "--runtime", runc, *ulimits(), *spec.options, image]
    cmd += [*spec.args, *extra_args, "--metrics-address", f"127.0.0.1:{port}"]
    podman(*cmd)
    try:
        yield RunningAgent(name, port, state_dir)
    finally:
        podman("rm", "-f", "-t", "5", name, check=False, timeout=60)


def summary(agent: RunningAgent) -> str:
    """For assertion messages: the container's state and the end of its log."""
    try:
        status = json.dumps(agent.status().get("agent", {}))
    except (OSError, StatusUnavailableError) as err:
        status = f"(no status: {err})"
    return f"running={agent.running()} status={status}\n--- podman logs ---\n{agent.logs()}"
