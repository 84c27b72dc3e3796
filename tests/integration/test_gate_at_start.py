"""The device gate from the agent's first instant, with real processes: the agent restarts (a
DaemonSet rollout) while the API server does not answer its pod list, and pods start in that
window, before its pod cache has synced and before kubelet can reach its device plugin.

Each pod's container opens the GPU device nodes again and again from its first instruction
(nodes made with mknod; there is no NVIDIA driver here, so an open the cgroup lets through
fails with ENXIO and one the cgroup refuses with EPERM). A pod without GPUs never opens
one; a GPU pod admitted by the agent before the restart never opens another GPU, and opens
its own once the new agent knows it again.

The pods' cgroups are made as kubelet makes them, the pod's before its containers'; the
test waits for the agent's own log line saying the pod is gated (its state), never for a
fixed time, before the container starts.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.emulators.cluster import container_id
from agent.emulators.containers import RunningContainer
from agent.emulators.enforcednode import EnforcedNode, enforced_node, pod_manifest, stop_process, wait_for
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.paths import QosClass, pod_relpath
from tests.integration.cgroup_trees import real_layout

pytestmark = pytest.mark.privileged

EPERM, ENXIO = 1, 6
PODS_PATH = "/api/v1/pods"  # the agent's list and watch of the pods on its node

# Opens each node given in a loop until the stop file appears, counting each outcome, and
# publishes the counts after every round (written aside, then renamed: never read half).
PROBE = r"""
import errno, json, os, sys
out, stop, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
counts = {p: {"allowed": 0, "denied": 0, "other": 0} for p in paths}
while not os.path.exists(stop):
    for p in paths:
        try:
            os.close(os.open(p, os.O_RDWR))
            counts[p]["allowed"] += 1
        except OSError as err:
            key = "allowed" if err.errno == errno.ENXIO else "denied" if err.errno == errno.EPERM else "other"
            counts[p][key] += 1
    with open(out + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out + ".tmp", out)
"""


@pytest.fixture
def node(short_dir: Path) -> Iterator[EnforcedNode]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    with enforced_node(short_dir, "2xH100-80GB", agent_args=("--no-ioctl-tracing",)) as made:
        yield made


def gpu_nodes(directory: Path) -> list[Path]:
    paths = []
    for minor in (0, 1):
        path = directory / f"nvidia{minor}"
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, minor))
        paths.append(path)
    return paths


def counts(out: Path) -> dict[str, dict[str, int]] | None:
    try:
        found: dict[str, dict[str, int]] = json.loads(out.read_text())
    except FileNotFoundError:
        return None
    return found


def gated_line(node: EnforcedNode, uid: str) -> re.Match[str] | None:
    return re.search(rf"device gate: pod {re.escape(uid)} limited to [^\n]*", node.agent_log())


def start_probe(
    node: EnforcedNode, name: str, uid: str, *, gpu: int, paths: list[Path], workdir: Path
) -> tuple[RunningContainer, Path]:
    """The pod's cgroup first (kubelet), the gate's rules on it, then the container."""
    pod = node.api.pod("default", name)
    assert pod is not None
    qos = QosClass(pod["status"]["qosClass"])
    pod_dir = node.cgroup_root / pod_relpath(CgroupDriver.CGROUPFS, uid, qos)
    pod_dir.mkdir(parents=True, exist_ok=True)
    wait_for(lambda: gated_line(node, uid), 30, f"the gate's rules on {name}'s pod cgroup")
    out = workdir / f"{name}.json"
    box = node.runtime.start(
        f"default/{name}/c",
        pod_uid=uid,
        qos=qos,
        container_id=container_id(uid, "c"),
        gpu=gpu,
        command=[sys.executable, "-c", PROBE, str(out), str(workdir / "stop"), *map(str, paths)],
    )
    return box, out


def attempts(found: dict[str, dict[str, int]] | None, path: Path) -> int:
    return 0 if found is None else sum(found[str(path)].values())


def test_pods_started_before_the_pod_cache_syncs_get_no_gpu_not_their_own(
    node: EnforcedNode, short_dir: Path
) -> None:
    paths = gpu_nodes(short_dir)
    # Admitted by the agent before its restart: kubelet holds the pod's devices, and starts its
    # container later (the new agent's ledger is rebuilt only once its pod list came).
    admission = node.node.run_pod(pod_manifest("holder", 30, 1024, {}))
    own = node.gpu_index(admission.containers[0].response.envs["VCUDA_GPU_UUIDS"].split(",")[0])
    other = 1 - own
    plain = node.node.create_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "plain", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "cuda"}]},
        }
    )

    stop_process(node.agent)  # the rollout: the old agent is gone...
    node.api.refuse("GET", PODS_PATH)  # ...and the new one gets no pod list for now
    seen = len(node.api.request_log)
    starting: dict[str, Any] = {}
    restart = threading.Thread(target=lambda: starting.setdefault("agent", node.start_agent()))
    restart.start()
    try:
        wait_for(lambda: "device guard: enforce" in node.agent_log(), 60, "the new agent's device guard")
        holder, holder_out = start_probe(
            node, "holder", admission.pod.uid, gpu=own, paths=paths, workdir=short_dir
        )
        free, free_out = start_probe(node, "plain", plain.uid, gpu=own, paths=paths, workdir=short_dir)
        for out in (holder_out, free_out):
            wait_for(lambda: attempts(counts(out), paths[other]) >= 50, 60, f"opens in {out.name}")  # noqa: B023
        # Still before the sync: the agent has had no pod list.
        asked = [r for r in node.api.request_log[seen:] if r.path == PODS_PATH]
        assert asked and all(r.status >= 500 for r in asked), asked
        assert restart.is_alive(), "the agent registered with kubelet without its pod list"
        before = {"holder": counts(holder_out), "plain": counts(free_out)}
        for found in before.values():
            assert found is not None
            assert found[str(paths[other])]["allowed"] == 0, before
            assert found[str(paths[other])]["other"] == 0, before
        plain_before = before["plain"]
        assert plain_before is not None and plain_before[str(paths[own])]["allowed"] == 0, before

        node.api.allow()  # the pod list comes: the pods are known, the ledger rebuilt
        restart.join(90)
        assert not restart.is_alive(), "the agent did not register once its pod list came"
        wait_for(
            lambda: (counts(holder_out) or {}).get(str(paths[own]), {}).get("allowed", 0) > 0,
            60,
            "the holder opening its own GPU once the agent knows it",
        )
        after = {"holder": counts(holder_out), "plain": counts(free_out)}
        for found in after.values():
            assert found is not None and found[str(paths[other])]["allowed"] == 0, after
        plain_after = after["plain"]
        assert plain_after is not None and plain_after[str(paths[own])]["allowed"] == 0, after
        assert holder.proc.poll() is None and free.proc.poll() is None
    finally:
        node.api.allow()
        (short_dir / "stop").touch()
        restart.join(90)
