"""deploy/ for the scheduler extender: the KubeSchedulerConfiguration's extender entry reaches
the Service and the verbs the server answers, the Deployment's args are ones the CLI accepts,
the second scheduler mounts the config it is told to read, and the extender's ClusterRole is
exactly what a running extender uses against the (fake) API server."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from agent.surfaces.cli.extender import settings_from
from agent.surfaces.cli.main import build_parser
from agent.surfaces.extender.transport import server_context
from tests.integration.deploy_render import Doc, one, render
from tests.integration.extenderkit import bind_body, gpu_pod, inventory_text, post, running_extender
from tests.integration.kubeapi import apiserver, wait_until
from tests.integration.test_rbac import needed  # an API request -> the (resource, verb) RBAC needs

__all__ = ["apiserver"]
ROOT = Path(__file__).resolve().parents[2]
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
    assert url.scheme == "https" and entry["enableHTTPS"] is True
    assert set(entry["tlsConfig"]) == {"certFile", "keyFile", "caFile"}
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
    assert all(
        p["httpGet"]["scheme"] == "HTTPS" for p in (container["readinessProbe"], container["livenessProbe"])
    )


def _secret_files(pod: Doc, container: Doc, mount_dir: PurePosixPath) -> tuple[str, str]:
    """(Secret name, its mount) for the Secret volume mounted at ``mount_dir``."""
    [mount] = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == mount_dir]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return str(volume["secret"]["secretName"]), str(mount["mountPath"])


def _secrets_made_by_the_script() -> dict[str, dict[str, str]]:
    """Secret name -> {key: the script's file} from make-certs.sh's `kubectl create secret` lines."""
    text = (ROOT / "deploy/extender-tls/make-certs.sh").read_text().replace("\\\n", " ")
    secrets: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if "create secret generic" in line:
            name = line.split("create secret generic", 1)[1].split()[0]
            files = re.findall(r"--from-file=([\w.]+)=\"\$out/([\w.]+)\"", line)
            secrets[name] = dict(files)
    return secrets


def test_the_extender_serves_https_with_the_secret_the_script_makes(tmp_path: Path) -> None:
    """The Deployment's TLS flags point into a mounted Secret whose keys make-certs.sh writes;
    with those files the server context builds (client CA included); the second scheduler
    mounts the client Secret where its tlsConfig looks."""
    docs = render("deploy/overlays/scheduler")
    made = _secrets_made_by_the_script()
    extender = one(docs, "Deployment", "vcuda-extender")["spec"]["template"]["spec"]
    [container] = extender["containers"]
    settings = settings_from(build_parser().parse_args([*container["command"][1:], *container["args"]]))
    assert settings.tls_cert and settings.tls_key and settings.client_ca
    paths = (settings.tls_cert, settings.tls_key, settings.client_ca)
    assert len({PurePosixPath(p).parent for p in paths}) == 1
    secret, mount = _secret_files(extender, container, PurePosixPath(settings.tls_cert).parent)
    subprocess.run(
        [str(ROOT / "deploy/extender-tls/make-certs.sh"), str(tmp_path)], check=True, capture_output=True
    )
    local = {p: tmp_path / made[secret][PurePosixPath(p).name] for p in paths}
    tls = server_context(
        replace(
            settings,
            tls_cert=local[settings.tls_cert],
            tls_key=local[settings.tls_key],
            client_ca=local[settings.client_ca],
        )
    )
    assert tls is not None and tls.verify_mode.name == "CERT_OPTIONAL"
    assert PurePosixPath(mount) == PurePosixPath(settings.tls_cert).parent
    scheduler = one(docs, "Deployment", "vcuda-scheduler")["spec"]["template"]["spec"]
    [kube_scheduler] = scheduler["containers"]
    tls_config = scheduler_config(docs)["extenders"][0]["tlsConfig"]
    client_dir = PurePosixPath(tls_config["certFile"]).parent
    client_secret, _ = _secret_files(scheduler, kube_scheduler, client_dir)
    names = {PurePosixPath(tls_config[k]).name for k in ("certFile", "keyFile", "caFile")}
    assert names == set(made[client_secret]) and made[client_secret]["tls.crt"] == "client.crt"
    assert made[secret]["tls.crt"] == "server.crt"


def test_only_the_scheduler_reaches_the_extender() -> None:
    docs = render("deploy/overlays/scheduler")
    policy = one(docs, "NetworkPolicy", "vcuda-extender")
    extender = one(docs, "Deployment", "vcuda-extender")["spec"]["template"]["metadata"]["labels"]
    scheduler = one(docs, "Deployment", "vcuda-scheduler")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= extender.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    [source] = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= scheduler.items()
    assert not source["podSelector"]["matchLabels"].items() <= extender.items()  # not any pod of ours
    assert [p["port"] for p in rule["ports"]] == [3456]


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
