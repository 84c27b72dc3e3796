"""deploy/ for the scheduler extender: the KubeSchedulerConfiguration's extender entry reaches
the Service and the verbs the server answers, the Deployment's args are ones the CLI accepts,
the second scheduler mounts the config it is told to read, and the extender's ClusterRole is
exactly what a running extender uses against the (fake) API server."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from agent.surfaces.cli.extender import settings_from
from agent.surfaces.cli.main import build_parser
from tests.integration.deploy_render import Doc, one, render
from tests.integration.extenderkit import bind_body, gpu_pod, inventory_text, post, running_extender
from tests.integration.kubeapi import apiserver, wait_until
from tests.integration.test_rbac import needed  # an API request -> the (resource, verb) RBAC needs

__all__ = ["apiserver"]
# KubeSchedulerConfiguration v1 Extender fields (k8s.io/kube-scheduler/config/v1 types.go).
EXTENDER_FIELDS = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}


def scheduler_config(docs: list[Doc]) -> dict[str, Any]:
    [config_map] = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("vcuda-scheduler-config")
    ]
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["scheduler-config.yaml"])
    return config


def test_the_extender_entry_reaches_the_service_and_its_verbs() -> None:
    docs = render("deploy")
    config = scheduler_config(docs)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    [entry] = config["extenders"]
    assert set(entry) <= EXTENDER_FIELDS, set(entry) - EXTENDER_FIELDS
    url = urlsplit(entry["urlPrefix"])
    service = one(docs, "Service", "vcuda-extender")
    assert url.scheme == "http" and not entry["enableHTTPS"]
    assert url.hostname == f"vcuda-extender.{service['metadata']['namespace']}.svc"
    [port] = service["spec"]["ports"]
    assert url.port == port["port"]
    # The server routes <urlPrefix>/<verb>: exactly these three.
    assert (entry["filterVerb"], entry["prioritizeVerb"], entry["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert "preemptVerb" not in entry
    assert {(r["name"], r["ignoredByScheduler"]) for r in entry["managedResources"]} == {
        ("nvidia.com/vcuda-core", False),
        ("nvidia.com/vcuda-memory", False),
    }
    assert entry["ignorable"] is False and entry["nodeCacheCapable"] is True
    assert isinstance(entry["weight"], int) and entry["weight"] > 0
    assert [p["schedulerName"] for p in config["profiles"]] == ["vcuda-scheduler"]


def test_the_extender_deployment_runs_what_the_cli_accepts() -> None:
    docs = render("deploy")
    deployment = one(docs, "Deployment", "vcuda-extender")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"  # reservations are in memory
    [container] = spec["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["vcuda-agent", "extender"]
    args = build_parser().parse_args([*command[1:], *container.get("args", [])])
    settings = settings_from(args)
    [port] = container["ports"]
    assert settings.port == port["containerPort"]
    service = one(docs, "Service", "vcuda-extender")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["template"]["spec"]["serviceAccountName"] == "vcuda-extender"


def test_the_second_scheduler_reads_the_mounted_config() -> None:
    docs = render("deploy/overlays/scheduler")
    deployment = one(docs, "Deployment", "vcuda-scheduler")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"].startswith("registry.k8s.io/kube-scheduler:")
    [flag] = [a for a in container["command"] if a.startswith("--config=")]
    path = PurePosixPath(flag.split("=", 1)[1])
    [mount] = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    assert path.name in config_map["data"]
    assert scheduler_config(docs)["profiles"][0]["schedulerName"] == "vcuda-scheduler"
    binding = one(docs, "ClusterRoleBinding", "vcuda-scheduler")
    assert binding["roleRef"]["name"] == "system:kube-scheduler"
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def _granted(docs: list[Doc]) -> set[tuple[str, str]]:
    role = one(docs, "ClusterRole", "vcuda-extender")
    return {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


def test_the_extender_role_is_exactly_what_the_extender_uses(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    apiserver.create_node("gpu-one", annotations={INVENTORY_ANNOTATION: inventory_text("gpu-one", 1)})
    with running_extender(apiserver, apiserver.write_kubeconfig(tmp_path / "kc")) as ext:
        pod = apiserver.create_pod(gpu_pod("p", 50, 1024))
        status, result = post(ext.url, "bind", bind_body(pod, "gpu-one"))
        assert status == 200 and not result.get("error")
        wait_until(lambda: not ext.view.reservations())
    used = {needed(r.method, r.path, r.query) for r in apiserver.request_log}
    assert used == _granted(render("deploy"))
