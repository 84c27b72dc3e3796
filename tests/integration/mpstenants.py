"""MPS tenants of an enforced simulated node as real processes of any uid: the system's Python
with the standard library only (a checkout may sit where uid 1000 cannot read it), talking
to the GPU server and, to cheat, to the MPS control socket every client reaches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agent.emulators.containers import RunningContainer
from agent.emulators.enforcednode import EnforcedNode, pod_manifest
from agent.platform.mpsv3 import namespace_name

SYSTEM_PYTHON = str(Path(sys.base_exec_prefix) / "bin" / "python3")
# A container securityContext that proves it cannot run as root: MPS v3 trusts it to a namespace.
NON_ROOT: dict[str, Any] = {"runAsUser": 1000, "runAsNonRoot": True, "allowPrivilegeEscalation": False}

# argv: GPU server socket, GPU index, a control command to send first ("": none), kernels
# queued per sync, kernel length in ms. Runs kernels as an MPS client with its
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE where Allocate gave it a pipe directory, else as a
# time-sliced context.
TENANT = """
import json, os, socket, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
if sys.argv[3] and pipe:
    ctl = socket.socket(socket.AF_UNIX)
    ctl.connect(pipe + "/control")
    ctl.sendall(sys.argv[3].encode() + b"\\n\\n")
    ctl.shutdown(socket.SHUT_WR)
    print("control:", ctl.makefile().read().strip(), flush=True)
gpu = socket.socket(socket.AF_UNIX)
gpu.connect(sys.argv[1])
replies = gpu.makefile()
def ask(message):
    gpu.sendall(json.dumps(message).encode() + b"\\n")
    return json.loads(replies.readline())
share = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
opened = ask({"op": "open", "gpu": int(sys.argv[2]), "share": share, "mps_pipe": pipe})
assert opened["ok"], opened
while True:
    ask({"op": "launch", "count": int(sys.argv[4]), "kernel_ms": float(sys.argv[5])})
    ask({"op": "sync"})
"""


def start_tenant(
    node: EnforcedNode,
    name: str,
    cores: int,
    *,
    user: int | None,
    lift: bool = False,
    queue: int = 1,
    kernel_ms: float = 2,
    env: dict[str, str] | None = None,
    security: dict[str, Any] | None = NON_ROOT,
) -> tuple[RunningContainer, Path | None, str]:
    """A pod of ``cores`` as ``user`` (None: root), whose container (``lift``) first sets its
    own MPS v3 namespace to 100 % through the control socket and asks for 100 % in its env;
    ``queue``: kernels of ``kernel_ms`` it queues at a time (longer ones leave less of its
    throughput to how soon a busy host lets it submit the next batch). Returns it, its pipe directory (host
    path, None: no MPS grant) and its namespace's name. ``security``: the container's
    securityContext in its pod spec (what the agent decides by; ``user`` is what it runs as)."""
    admission = node.node.run_pod(pod_manifest(name, cores, 1024, {}, security))
    response = admission.containers[0].response
    envs = dict(response.envs)
    mounts = {m.container_path: m.host_path for m in response.mounts}
    pipe = Path(mounts[envs["CUDA_MPS_PIPE_DIRECTORY"]]) if "CUDA_MPS_PIPE_DIRECTORY" in envs else None
    namespace = namespace_name(admission.pod.uid, "c")
    sim = node.runtime.sim_state_dir
    dirs = [] if pipe is None else [*(p for p in pipe.parents if p.is_relative_to(node.workdir)), pipe]
    for path in (node.workdir, *dirs, sim):
        path.chmod(0o755)  # a uid-1000 client must reach the GPU server's socket and the control socket
    (sim / "gpu.sock").chmod(0o777)
    if pipe is not None:
        (pipe / "control").chmod(0o777)
    command = f"namespace set --name={namespace} --active-thread-percentage=100" if lift else ""
    gpu = node.gpu_index(envs["VCUDA_GPU_UUIDS"].split(",")[0])
    argv = [SYSTEM_PYTHON, "-c", TENANT, str(sim / "gpu.sock"), str(gpu), command, str(queue), str(kernel_ms)]
    own = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"} if lift else {}
    box = node.start_container(admission, env={**own, **(env or {})}, user=user, command=argv)
    return box, pipe, namespace
