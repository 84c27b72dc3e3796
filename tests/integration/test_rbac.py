"""The ClusterRole in deploy/ is exactly what a running agent uses: every API request the
agent makes against the fake API server is allowed by a rule, and every rule is used."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from agent.domain.ids import encode
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.channel import unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.conftest import AgentProcess
from tests.integration.kubecluster import Cluster, pod_manifest, wait_until

ROOT = Path(__file__).resolve().parents[2]
_PATH = re.compile(
    r"^/api/v1(?:/namespaces/[^/]+)?/(?P<res>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def rendered_rules() -> set[tuple[str, str]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy")], capture_output=True, text=True, check=True
    )
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(out.stdout) if d]
    roles = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "vcuda-agent"]
    assert len(roles) == 1
    granted: set[tuple[str, str]] = set()
    for rule in roles[0]["rules"]:
        assert rule["apiGroups"] == [""], "the agent only talks to the core API group"
        granted |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    return granted


def needed(method: str, path: str, query: dict[str, str]) -> tuple[str, str]:
    match = _PATH.match(path)
    assert match, f"unexpected API path {path}"
    resource = match["res"] + (f"/{match['sub']}" if match["sub"] else "")
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else ("get" if match["name"] else "list")
    else:
        verb = _VERBS[method]
    return resource, verb


def test_the_cluster_role_is_exactly_what_the_agent_uses(
    start_agent: Callable[..., AgentProcess], cluster: Cluster
) -> None:
    agent = start_agent("2xH100-80GB", kube=cluster.kube)
    cluster.kubelet.wait_for_plugin(timeout_s=30)
    # Exercise every path: Allocate + annotations, a bad annotation (event), a refusal twice
    # (the second identical event is aggregated with a patch), capacity zeroed by kubelet.
    cluster.node.run_pod(
        pod_manifest("ok", ("cuda", 10, 1024), annotations={"nvidia.com/vcuda-core-limit": "x"})
    )
    cluster.node.create_pod(pod_manifest("greedy", ("cuda", 10, 10**6)))
    uuid = SimNodeDir(agent.sim_dir).read_node().gpus[0].uuid
    request = pb.AllocateRequest(
        container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[encode(uuid, 90 + n) for n in range(10)])
        ]
    )
    with grpc.insecure_channel(unix_target(agent.plugin_dir / "vcuda-core.sock")) as channel:
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                pb_grpc.DevicePluginStub(channel).Allocate(request, timeout=10)
    cluster.api.zero_extended_resources("test-node")
    wait_until(lambda: _capacity(cluster) not in (None, "0"), what="capacity re-asserted")
    wait_until(
        lambda: [e.get("count") for e in cluster.api.events() if e["reason"] == "GPUOversubscribed"] == [2]
    )
    wait_until(lambda: any(e["reason"] == "InvalidGPUAnnotation" for e in cluster.api.events()))
    used = {needed(r.method, r.path, r.query) for r in cluster.api.request_log}
    granted = rendered_rules()
    assert used <= granted, f"the agent needs rules it does not have: {sorted(used - granted)}"
    assert granted <= used, f"rules the agent never uses: {sorted(granted - used)}"
    assert agent.proc.poll() is None


def _capacity(cluster: Cluster) -> str | None:
    node = cluster.api.node("test-node") or {}
    value = (node.get("status") or {}).get("capacity", {}).get("nvidia.com/vcuda-memory")
    return None if value is None else str(value)
