"""The ClusterRoles in deploy/ are exactly what a running agent uses: every API request the
agent makes against the fake API server is allowed by a rule, and every rule is used. The
base's ClusterRole ``vcuda-agent`` by the device plugin; the DRA overlay's ``vcuda-agent-dra``
by the agent run with the overlay's DRA args, publishing its slice and preparing a claim."""

from __future__ import annotations

import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from agent.domain.dra import DRIVER, claim_ref
from agent.domain.draslice import slice_name
from agent.domain.ids import encode
from agent.emulators.draadmission import claim_pod, claim_template
from agent.emulators.draclaims import PodClaims
from agent.emulators.kubelet_dra import KubeletDraEmulator
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.sim.client import post_event
from agent.platform.gpu.sim.nodefile import SimNodeDir
from agent.platform.kubelet.channel import unix_target
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.conftest import AgentProcess
from tests.integration.deploy_render import daemonset_metrics_args
from tests.integration.kubecluster import NODE, Cluster, pod_manifest, wait_until
from tests.unit.drafixtures import node_slice

ROOT = Path(__file__).resolve().parents[2]
_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/[^/]+)?"
    r"/(?P<res>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}

Doc = dict[str, Any]
Rule = tuple[str, str, str]  # (API group, resource, verb); "" is the core group


def render(directory: str) -> list[Doc]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / directory)], capture_output=True, text=True, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def rendered_rules(directory: str = "deploy", role: str = "vcuda-agent") -> set[Rule]:
    roles = [d for d in render(directory) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role]
    assert len(roles) == 1
    granted: set[Rule] = set()
    for rule in roles[0]["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, "not modelled here"
        granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return granted


def needed(method: str, path: str, query: dict[str, str]) -> tuple[str, str]:
    """The (resource, verb) a core-group request needs (test_deploy_extender.py uses it too)."""
    group, resource, verb = needed_rule(method, path, query)
    assert group == "", f"{method} {path} is not in the core API group"
    return resource, verb


def needed_rule(method: str, path: str, query: dict[str, str]) -> Rule:
    match = _PATH.match(path)
    assert match, f"unexpected API path {path}"
    resource = match["res"] + (f"/{match['sub']}" if match["sub"] else "")
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else ("get" if match["name"] else "list")
    else:
        verb = _VERBS[method]
    return match["group"] or "", resource, verb


def used_rules(cluster: Cluster) -> set[Rule]:
    return {needed_rule(r.method, r.path, r.query) for r in cluster.api.request_log}


def scrape_with(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_cluster_role_is_exactly_what_the_agent_uses(
    start_agent: Callable[..., AgentProcess], cluster: Cluster
) -> None:
    agent = start_agent("2xH100-80GB", *daemonset_metrics_args(), kube=cluster.kube)
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
    # Prometheus scrapes as the monitoring overlay's scraper account, bound as deploy/ binds it:
    # the agent reviews the token and the account's access (its tokenreviews and
    # subjectaccessreviews rules); a pod's own token is refused.
    for doc in render("deploy/overlays/monitoring"):
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            cluster.api.create_object(doc["kind"].lower() + "s", doc)
    port = agent.metrics_port()
    assert scrape_with(port, None)[0] == 401
    assert scrape_with(port, cluster.api.auth.service_account_token("default", "default"))[0] == 403
    scraper = cluster.api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
    code, text = scrape_with(port, scraper)
    assert code == 200 and 'pod="ok"' in text
    used = used_rules(cluster)
    granted = rendered_rules()
    reviews = {"authentication.k8s.io", "authorization.k8s.io"}  # --metrics-auth kubernetes
    assert {g for g, _, _ in granted} == {"", *reviews}, "the base's agent: the core group and reviews"
    assert used <= granted, f"the agent needs rules it does not have: {sorted(used - granted)}"
    assert granted <= used, f"rules the agent never uses: {sorted(granted - used)}"
    assert agent.proc.poll() is None


@pytest.fixture
def kubelet_dra(short_dir: Path) -> Iterator[KubeletDraEmulator]:
    emulator = KubeletDraEmulator(short_dir / "reg")
    emulator.start()
    yield emulator
    emulator.stop()


def dra_overlay_args() -> list[str]:
    """What deploy/overlays/dra adds to the base DaemonSet's args."""

    def args(directory: str) -> list[str]:
        [daemonset] = [d for d in render(directory) if d["kind"] == "DaemonSet"]
        found: list[str] = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
        return found

    base, dra = args("deploy"), args("deploy/overlays/dra")
    assert dra[: len(base)] == base, "the overlay appends to the base's args"
    return dra[len(base) :]


def test_the_dra_cluster_role_is_exactly_what_the_dra_driver_uses(
    start_agent: Callable[..., AgentProcess],
    cluster: Cluster,
    kubelet_dra: KubeletDraEmulator,
    short_dir: Path,
) -> None:
    # A leftover slice of the driver on this node (say, from a renamed node): deleted.
    stale = node_slice(NODE)
    stale["metadata"]["name"] = f"{NODE}-old"
    cluster.api.create_object("resourceslices", stale)
    # The overlay's args (--dra, --dra-gpus all), its host directories moved under short_dir.
    directories = ["--dra-registry-dir", str(short_dir / "reg"), "--dra-plugin-dir", str(short_dir / "dra")]
    directories += ["--cdi-dir", str(short_dir / "cdi")]
    agent = start_agent("2xH100-80GB", *dra_overlay_args(), *directories, kube=cluster.kube)
    kubelet_dra.wait_for_plugin(DRIVER, timeout_s=30)

    def devices() -> list[str] | None:
        obj = cluster.api.get_object("resourceslices", slice_name(NODE))
        return None if obj is None else [d["name"] for d in obj["spec"]["devices"]]

    assert wait_until(devices, timeout_s=30, what="the slice published") == ["gpu-0", "gpu-1"]
    wait_until(lambda: cluster.api.get_object("resourceslices", f"{NODE}-old") is None, what="stale gone")
    # The device plugin keeps registering, with nothing to offer: every GPU is DRA's.
    assert cluster.kubelet.wait_for_plugin(timeout_s=30).devices == {}
    # A claim allocated from the slice and prepared: the plugin reads it from the API.
    [klass] = [d for d in render("deploy/overlays/dra") if d["kind"] == "DeviceClass"]
    cluster.api.create_object("deviceclasses", klass)
    cluster.api.create_object(
        "resourceclaimtemplates", claim_template("share", 30, 4096, None, None), "default"
    )
    cluster.node.create_pod(claim_pod("share", "share"))
    [claim] = PodClaims(cluster.api.store).admit("default", "share", NODE)
    ref = claim_ref(claim)
    result = kubelet_dra.prepare(DRIVER, [ref])[ref.uid]
    assert not result.error and result.devices, result
    # A GPU turns unhealthy: the slice is replaced without it.
    post_event(agent.sim_dir, 1, EventKind.XID.value, xid=79)
    wait_until(lambda: devices() == ["gpu-0"], what="gpu-1 leaves the slice")
    # A clean stop withdraws the slice.
    assert agent.stop() == 0
    assert devices() is None
    used = used_rules(cluster)
    dra = {rule for rule in used if rule[0] == "resource.k8s.io"}
    granted = rendered_rules("deploy/overlays/dra", "vcuda-agent-dra")
    assert dra <= granted, f"the DRA driver needs rules it does not have: {sorted(dra - granted)}"
    assert granted <= dra, f"rules the DRA driver never uses: {sorted(granted - dra)}"
    # Everything else it asked is the base role's (the base test shows that role is all used).
    rest = used - dra
    base = rendered_rules("deploy/overlays/dra", "vcuda-agent")
    assert rest <= base, f"the agent with --dra needs rules it does not have: {sorted(rest - base)}"


def _capacity(cluster: Cluster) -> str | None:
    node = cluster.api.node("test-node") or {}
    value = (node.get("status") or {}).get("capacity", {}).get("nvidia.com/vcuda-memory")
    return None if value is None else str(value)
