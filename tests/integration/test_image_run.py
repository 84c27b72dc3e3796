"""The image, built and run here the way the DaemonSet runs it.

`make image`'s script (deploy/image/build.sh: podman, a debootstrap base standing in for
Docker Hub's debian:bookworm-slim, cached) builds ghcr.io/vcuda-agent/vcuda-agent:<version>;
then podman runs it with what deploy/base/daemonset.yaml asks of the node (privileged, host
pid and network, every volumeMount at its hostPath, env, args; tests/integration/image_run.py
derives the options from the YAML) plus `--simulate 2xH100-80GB --no-kube --metrics-auth none`
(no API server to check a scrape's token with). Stand-ins: the
kubelet emulator's directory for the device-plugins hostPath, temp dirs for pod-resources
and the state hostPath, the ConfigMap projected from deploy/base/config.json.

What must work through those mounts: the device plugin registers with the emulator through
the mounted plugin dir, /metrics answers on the host network, the BPF tracer is `ok`
(compiled against the host's /lib/modules and /usr/src), the simulated node's files appear
on the state hostPath, and SIGTERM (`podman stop`) stops the agent with exit 0, its socket removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.emulators.kubelet import KubeletEmulator
from tests.integration.deploy_render import ROOT
from tests.integration.freezing import wait_for
from tests.integration.image_run import (
    BUILD_SCRIPT,
    agent_container,
    config_dir,
    daemonset,
    http_get,
    image_name,
    pod_spec,
    podman,
    summary,
)

pytestmark = pytest.mark.privileged

# Without an API server no scrape's token can be checked: the DaemonSet's --metrics-auth
# kubernetes is refused with --no-kube, so the last word here is none.
SIMULATE = ("--simulate", "2xH100-80GB", "--no-kube", "--metrics-auth", "none")
NODE = "image-node"


def missing_tools() -> str:
    if os.geteuid() != 0:
        return "not root: podman's root storage, a privileged container and BPF need it"
    absent = [t for t in ("podman", "debootstrap", "runc") if shutil.which(t) is None]
    if absent:
        return f"{', '.join(absent)} not installed (deploy/host/setup.sh installs them)"
    return ""


@pytest.fixture(scope="session")
def built_image() -> str:
    """`deploy/image/build.sh` (what `make image` runs): the base is cached between runs,
    podman's layer cache makes a rebuild of an unchanged tree quick."""
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    start = time.monotonic()
    out = subprocess.run([str(BUILD_SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"make image failed:\n{out.stdout[-6000:]}\n{out.stderr[-4000:]}"
    image = image_name(daemonset())
    podman("image", "exists", image)
    print(f"built {image} in {time.monotonic() - start:.1f} s: {out.stdout.strip().splitlines()[-1]}")
    return image


@pytest.fixture
def host_dirs(short_dir: Path) -> Iterator[dict[str, Path]]:
    dirs = {
        "device-plugins": short_dir / "dp",
        "pod-resources": short_dir / "pr",
        "state": short_dir / "state",
        "config": config_dir(short_dir / "config"),
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    yield dirs


def test_the_image_runs_as_the_daemonset_runs_it(built_image: str, host_dirs: dict[str, Path]) -> None:
    kubelet = KubeletEmulator(host_dirs["device-plugins"])
    kubelet.start()
    fields = {"spec.nodeName": NODE, "metadata.uid": str(uuid.uuid4())}
    spec = pod_spec(daemonset(), host_dirs, fields)
    name = f"vcuda-image-test-{os.getpid()}"
    try:
        with agent_container(spec, built_image, host_dirs["state"], SIMULATE, name) as agent:
            # Registration through the mounted plugin dir: kubelet.sock in, vcuda-core.sock out.
            registered = wait_for(lambda: bool(kubelet.registrations) or not agent.running(), 90, 0.5)
            assert registered and kubelet.registrations, f"no registration with kubelet\n{summary(agent)}"
            plugin = kubelet.wait_for_plugin(timeout_s=30)
            assert len(plugin.healthy_ids()) == 200, "2 GPUs x 100 vcuda-core"
            assert (host_dirs["device-plugins"] / "vcuda-core.sock").is_socket()
            # /metrics on the host network; the tracer compiled against the host's headers.
            assert wait_for(lambda: agent.bpf_status() not in ("", "starting"), 120, 0.5), summary(agent)
            assert agent.bpf_status() == "ok", summary(agent)
            metrics = agent.metrics()
            assert 'vcuda_gpu_healthy{gpu="0"' in metrics and f'node="{NODE}"' in metrics
            assert http_get(agent.port, "/readyz")[0] == 200, summary(agent)
            # The state hostPath: the simulated node's files (--sim-state-dir's default is
            # under it). The status socket there is served with enforcement, which needs the
            # Kubernetes API: not with --no-kube.
            assert (host_dirs["state"] / "sim/node.json").is_file(), summary(agent)
            code = agent.stop()
            assert code == 0, f"SIGTERM: exit {code}\n{summary(agent)}"
            assert not (host_dirs["device-plugins"] / "vcuda-core.sock").exists()
    finally:
        kubelet.stop()
