"""deploy/helm/vcuda-agent, with the real helm (deploy/host/get-helm.sh): it lints; over a matrix
of values every object it renders is a valid Kubernetes object (strict schemas) that the agent's
own CLI and loaders accept; bad values are refused with the schema's message; and with the same
settings it renders exactly what the kustomize tree renders (the defaults as `deploy`, each
switch as its overlay), apart from Helm's own labels."""

from __future__ import annotations

import argparse
import base64
import json
import re
import socket
import ssl
import subprocess
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path, PurePosixPath

import pytest
import yaml

from agent.domain.nodeconfig import load_config, parse_config
from agent.settings import GuardMode, Settings
from agent.surfaces.cli.extender import settings_from as extender_settings_from
from agent.surfaces.cli.main import build_parser
from agent.surfaces.cli.run import settings_from_args
from agent.surfaces.extender.transport import server_context
from tests.integration.deploy_render import (
    AGENT,
    DRA_SCHEMA_VERSIONS,
    ROOT,
    Doc,
    check_service_monitor,
    container,
    mount_for,
    one,
    parse_run_args,
    validate,
)
from tests.integration.helm_render import (
    CHART,
    GET_HELM,
    HELM_LABELS,
    NAMESPACE,
    TOOLS,
    differences,
    key,
    kustomize,
    pinned_helm_version,
    run_helm,
    template,
    template_error,
)

# Kubernetes schemas every object is checked against: the oldest we claim, 1.36, the newest
# shipped; resource.k8s.io objects from 1.36 (consumable capacity).
SCHEMA_VERSIONS = ("1.30", "1.36", "1.37")
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
}

# Each overlay of deploy/overlays and the chart's switch for it.
SWITCHES: dict[str, tuple[str, ...]] = {
    "monitoring": ("--set", "monitoring.enabled=true"),
    "cdi": ("--set", "deviceListStrategy=cdi"),
    "scheduler": ("--set", "scheduler.enabled=true"),
    "mps": ("--set", "mps.enabled=true"),
    "dra": ("--set", "dra.enabled=true"),
}
EVERY_OVERLAY = tuple(a for args in SWITCHES.values() for a in args)
# And the certificates made by helm (a fresh CA with each `helm template`).
ALL_SWITCHES = (*EVERY_OVERLAY, "--set", "extender.tls.create=true")

NODE_CONFIG = [
    {
        "name": "gpu-node-1",
        "deviceMemoryScaling": 0.9,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "cgroupDriver": "cgroupfs",
        "sharingMode": "auto",
        "allowedPolicies": ["fixed-share", "burst-share", "best-effort"],
        "maxLimitRatio": 2,
        "mpsAdvisoryLimits": True,
    },
    {"name": "gpu-node-2.example.com", "deviceMemoryScaling": 0.5},
]
IMAGE = ("registry.example.com:5000/gpu/vcuda-agent", "0.2.0-rc.1")
DIGEST = "sha256:" + "ab" * 32
TOLERATIONS = [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}]
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}
            ]
        }
    }
}
RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def _json(name: str, value: object) -> tuple[str, str]:
    return "--set-json", f"{name}={json.dumps(value)}"


# id -> (helm flags, namespace)
MATRIX: dict[str, tuple[tuple[str, ...], str]] = {
    "defaults": ((), NAMESPACE),
    **{f"{name} alone": (args, NAMESPACE) for name, args in SWITCHES.items()},
    "extender certificates": (("--set", "extender.tls.create=true"), NAMESPACE),
    "all switches": (ALL_SWITCHES, NAMESPACE),
    "all switches elsewhere": (ALL_SWITCHES, "gpu-system"),
    "per-node config": (_json("config.nodeConfig", NODE_CONFIG), NAMESPACE),
    "custom image": (
        (
            *("--set", f"image.repository={IMAGE[0]},image.tag={IMAGE[1]},image.pullPolicy=Always"),
            *_json("imagePullSecrets", [{"name": "regcred"}]),
            *SWITCHES["scheduler"],
        ),
        NAMESPACE,
    ),
    "image by digest": (("--set", f"image.digest={DIGEST}"), NAMESPACE),
    "placement": (
        (
            *_json("tolerations", TOLERATIONS),
            # Maps merge with the chart's defaults: null drops the default label.
            *_json("nodeSelector", {"gpu": "true", "nvidia-device-enable": None}),
            *_json("affinity", AFFINITY),
            *_json("resources", RESOURCES),
            *_json("podLabels", {"team": "ml", "app.kubernetes.io/name": "not-the-agent"}),
            *_json("podAnnotations", {"example.com/owner": "ml-platform"}),
            *_json("updateStrategy", {"type": "OnDelete"}),
            *("--set", "runtimeClassName=nvidia,priorityClassName="),
        ),
        NAMESPACE,
    ),
    "gpu operator node": (
        (
            *("--set", "nvidiaDriverRoot=/run/nvidia/driver,host.mountUsrSrc=false,metrics.port=9500"),
            *_json("deviceGuard.exemptNamespaces", ["gpu-monitoring"]),
            *_json("extraArgs", ["--device-guard", "audit"]),
            *SWITCHES["monitoring"],
        ),
        NAMESPACE,
    ),
    "lean": (
        (
            "--set",
            "nodeScopePolicy.enabled=false,extender.enabled=false,metrics.auth=none,"
            "monitoring.enabled=true,config.existingConfigMap=my-node-config",
        ),
        NAMESPACE,
    ),
}


def render(case: str) -> list[Doc]:
    args, namespace = MATRIX[case]
    return template(*args, namespace=namespace)


def agent_settings(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What `vcuda-agent run` builds from the DaemonSet's args and downward-API env."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    monkeypatch.setenv("POD_UID", "0b5e3c6a-1d2f-4e5a-9b8c-7d6e5f4a3b2c")
    return settings_from_args(parse_run_args(container(one(docs, *AGENT))["args"]))


def extender_args(docs: list[Doc]) -> argparse.Namespace:
    [extender] = one(docs, "Deployment", "vcuda-extender")["spec"]["template"]["spec"]["containers"]
    assert extender["command"][:2] == ["vcuda-agent", "extender"]
    return build_parser().parse_args([*extender["command"][1:], *extender["args"]])


def pods(docs: list[Doc]) -> dict[str, Doc]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment")
    }


# ---- helm itself and the chart's metadata ----------------------------------------------------


def test_helm_is_the_pinned_release() -> None:
    out = run_helm("version", "--template", "{{.Version}}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == pinned_helm_version()


def test_get_helm_leaves_a_pinned_helm_alone() -> None:
    """`make setup` on an already set-up machine: no download, well under a second or two."""
    assert (TOOLS / "helm").exists(), "make setup puts helm in .tools"
    started = time.monotonic()
    out = subprocess.run(["bash", str(GET_HELM), str(TOOLS)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "fetching" not in out.stdout and time.monotonic() - started < 5


def test_the_chart_is_the_agents_release() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "vcuda-agent"
    assert chart["appVersion"] == version
    # The default image is the one the kustomize base names.
    image = container(one(template(), *AGENT))["image"]
    assert (
        image
        == f"ghcr.io/vcuda-agent/vcuda-agent:{version}"
        == container(one(kustomize("deploy"), *AGENT))["image"]
    )


@pytest.mark.parametrize("case", ["defaults", "all switches"])
def test_helm_lint_is_clean(case: str) -> None:
    out = run_helm("lint", "--strict", str(CHART), "--namespace", MATRIX[case][1], *MATRIX[case][0])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_the_packaged_chart_renders_as_the_directory(tmp_path: Path) -> None:
    out = run_helm("package", str(CHART), "--destination", str(tmp_path))
    assert out.returncode == 0, out.stderr
    [package] = tmp_path.glob("vcuda-agent-*.tgz")
    packaged = run_helm("template", "vcuda-agent", str(package), "--namespace", NAMESPACE, *EVERY_OVERLAY)
    assert packaged.returncode == 0, packaged.stderr
    assert [d for d in yaml.safe_load_all(packaged.stdout) if d] == template(*EVERY_OVERLAY)


# ---- every values set renders valid objects the agent accepts --------------------------------


@pytest.mark.parametrize("case", MATRIX)
def test_every_rendered_object_is_valid(case: str) -> None:
    docs = render(case)
    namespace = MATRIX[case][1]
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.keys() >= HELM_LABELS and labels["app.kubernetes.io/managed-by"] == "Helm", key(doc)
        # helm template does not add namespaces: each namespaced object names its own.
        assert ("namespace" in doc["metadata"]) == (doc["kind"] not in CLUSTER_SCOPED), key(doc)
        if doc["kind"] == "RoleBinding":  # kube-scheduler's reader of kube-system's auth config
            assert doc["metadata"]["namespace"] == "kube-system"
        elif "namespace" in doc["metadata"]:
            assert doc["metadata"]["namespace"] == namespace, key(doc)
        if doc["kind"] == "ServiceMonitor":  # a CRD: the fields the Operator needs, by hand
            check_service_monitor(doc, one(docs, "Service", "vcuda-agent-metrics"))
        else:
            _validate_once(doc)


_VALIDATED: set[str] = set()


def _validate_once(doc: Doc) -> None:
    """Strict validation against every schema version, once per distinct object: most objects
    are the same in most cases, and loading the schemas is what costs."""
    text = json.dumps(doc, sort_keys=True)
    if text not in _VALIDATED:
        dra = doc["apiVersion"].startswith("resource.k8s.io/")
        validate(doc, DRA_SCHEMA_VERSIONS if dra else SCHEMA_VERSIONS)
        _VALIDATED.add(text)


@pytest.mark.parametrize("case", MATRIX)
def test_the_agent_accepts_what_is_rendered(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(case)
    settings = agent_settings(docs, monkeypatch)  # raises on args the CLI refuses
    daemonset = one(docs, *AGENT)
    mounts = container(daemonset)["volumeMounts"]
    assert settings.config_file is not None
    config_mount = mount_for(PurePosixPath(settings.config_file), mounts)
    assert config_mount is not None and "subPath" not in config_mount
    [volume] = [
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == config_mount["name"]
    ]
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    if volume["configMap"]["name"] in config_maps:
        path = tmp_path / "config.json"
        path.write_text(config_maps[volume["configMap"]["name"]]["data"]["config.json"])
        load_config(path)  # raises ConfigError listing every problem
    if any(key(d) == ("Deployment", "vcuda-extender", MATRIX[case][1]) for d in docs):
        assert extender_settings_from(extender_args(docs)).port == 3456


# ---- the same objects as the kustomize tree --------------------------------------------------


@pytest.mark.parametrize(
    ("directory", "switch"),
    [("deploy", "")] + [(f"deploy/overlays/{name}", name) for name in SWITCHES],
)
def test_helm_renders_what_kustomize_renders(directory: str, switch: str) -> None:
    """Same objects (kind, name, namespace), and each with the same content: containers,
    images, args, volumes, RBAC rules, policies, config files (parsed). Only Helm's labels, the
    chart's checksum annotation and kustomize's hashed ConfigMap name are set aside."""
    problems = differences(kustomize(directory), template(*SWITCHES.get(switch, ())))
    assert not problems, "\n".join(problems)


def test_the_comparison_sees_a_changed_argument() -> None:
    """The normalisation above hides nothing that matters: one extra arg is one difference."""
    problems = differences(kustomize("deploy"), template(*_json("extraArgs", ["--device-guard", "audit"])))
    assert len(problems) == 1 and problems[0].startswith(
        "('DaemonSet', 'vcuda-agent', 'kube-system') differs"
    )
    assert re.search(r"^\+\s+- --device-guard\n\+\s+- audit$", problems[0], re.MULTILINE), problems[0]


# ---- what each value does ----------------------------------------------------------------------


def test_a_custom_image_reaches_every_vcuda_container() -> None:
    docs = render("custom image")
    specs = pods(docs)
    assert set(specs) == {"vcuda-agent", "vcuda-extender", "vcuda-scheduler"}
    for name in ("vcuda-agent", "vcuda-extender"):
        [c] = specs[name]["containers"]
        assert (c["image"], c["imagePullPolicy"]) == (f"{IMAGE[0]}:{IMAGE[1]}", "Always")
    for spec in specs.values():
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert specs["vcuda-scheduler"]["containers"][0]["image"] == "registry.k8s.io/kube-scheduler:v1.31.2"
    [c] = pods(render("image by digest"))["vcuda-extender"]["containers"]
    assert c["image"] == f"ghcr.io/vcuda-agent/vcuda-agent@{DIGEST}"


def test_placement_values_reach_the_agent_pod() -> None:
    docs = render("placement")
    daemonset = one(docs, *AGENT)
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["tolerations"] == TOLERATIONS
    assert spec["nodeSelector"] == {"gpu": "true"}
    assert spec["affinity"] == AFFINITY
    assert spec["runtimeClassName"] == "nvidia"
    assert "priorityClassName" not in spec
    assert container(daemonset)["resources"] == RESOURCES
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    template_meta = daemonset["spec"]["template"]["metadata"]
    assert template_meta["annotations"] == {"example.com/owner": "ml-platform"}
    assert template_meta["labels"]["team"] == "ml"
    assert template_meta["labels"]["app.kubernetes.io/name"] == "vcuda-agent", "podLabels cannot unselect it"
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= template_meta["labels"].items()
    # The extender has placement values of its own: unchanged.
    default = pods(template())["vcuda-extender"]
    assert pods(docs)["vcuda-extender"] == default


def test_a_per_node_config_is_the_config_map_the_agent_loads(tmp_path: Path) -> None:
    config_map = one(render("per-node config"), "ConfigMap", "gpu-manager-config")
    assert json.loads(config_map["data"]["config.json"]) == {"nodeConfig": NODE_CONFIG}
    config = parse_config(config_map["data"]["config.json"])
    node = config.for_node("gpu-node-1")
    assert (node.device_memory_scaling, node.cgroup_driver, node.sharing_mode) == (0.9, "cgroupfs", "auto")
    assert node.allowed_policies == ("fixed-share", "burst-share", "best-effort")
    assert (node.max_limit_ratio, node.mps_advisory_limits) == (2.0, True)
    assert node.container_runtime_endpoint == "unix:///run/containerd/containerd.sock"
    assert config.for_node("gpu-node-2.example.com").device_memory_scaling == 0.5
    empty = one(template("--set-json", "config.nodeConfig=[]"), "ConfigMap", "gpu-manager-config")
    assert parse_config(empty["data"]["config.json"]).nodes == {}


def test_a_gpu_operator_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidiaDriverRoot, the metrics port, the device guard's exempt namespaces, extraArgs and a
    host without /usr/src, as the agent reads them."""
    docs = render("gpu operator node")
    settings = agent_settings(docs, monkeypatch)
    assert settings.plugin.driver_root == Path("/run/nvidia/driver")
    assert settings.plugin.driver_root_in_agent == Path("/host/run/nvidia/driver")
    agent = container(one(docs, *AGENT))
    driver = mount_for(PurePosixPath("/host/run/nvidia/driver/usr/lib"), agent["volumeMounts"])
    assert driver is not None and driver["name"] == "host-root"
    assert settings.metrics.port == 9500 == agent["ports"][0]["containerPort"]
    assert one(docs, "Service", "vcuda-agent-metrics")["spec"]["ports"][0]["port"] == 9500
    assert agent["args"][-2:] == ["--device-guard", "audit"]
    assert settings.cgroups.guard_exempt_namespaces == frozenset({"gpu-monitoring"})
    assert settings.cgroups.device_guard is GuardMode.AUDIT
    volumes = {v["name"] for v in one(docs, *AGENT)["spec"]["template"]["spec"]["volumes"]}
    assert "usr-src" not in volumes and "usr-src" not in {m["name"] for m in agent["volumeMounts"]}


def test_switches_off_leave_their_objects_out() -> None:
    docs = render("lean")
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Deployment"}
    assert "ConfigMap" not in kinds, "the admin's own node config, and no scheduler config"
    volumes = one(docs, *AGENT)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": "my-node-config"}} in volumes
    # No token for an agent that asks none: no scraper account, a ServiceMonitor without one.
    assert container(one(docs, *AGENT))["args"][-2:] == ["--metrics-auth", "none"]
    assert not [d for d in docs if d["metadata"]["name"].startswith("vcuda-metrics-scraper")]
    [endpoint] = one(docs, "ServiceMonitor", "vcuda-agent")["spec"]["endpoints"]
    assert "authorization" not in endpoint


def test_another_namespace_is_used_wherever_the_namespace_is_named() -> None:
    """The policies' username, the scheduler's URL, RBAC subjects, the ServiceMonitor, the
    certificate: nothing but kube-scheduler's auth-reader binding stays in kube-system."""
    docs = render("all switches elsewhere")
    text = yaml.safe_dump_all(docs)
    assert text.count("kube-system") == 1, "only the RoleBinding vcuda-scheduler-auth-reader"
    user = "'system:serviceaccount:gpu-system:vcuda-agent'"
    for name in ("vcuda-agent-node-scope", "vcuda-agent-dra-node-scope"):
        [condition] = one(docs, "ValidatingAdmissionPolicy", name)["spec"]["matchConditions"]
        assert condition["expression"] == f"request.userInfo.username == {user}"
    config = yaml.safe_load(one(docs, "ConfigMap", "vcuda-scheduler-config")["data"]["scheduler-config.yaml"])
    assert config["extenders"][0]["urlPrefix"] == "https://vcuda-extender.gpu-system.svc:3456"
    for doc in docs:
        for subject in doc.get("subjects", []):
            assert subject["namespace"] == "gpu-system", key(doc)
    monitor = one(docs, "ServiceMonitor", "vcuda-agent")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["gpu-system"]


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> str:
    """A TLS handshake over a socket pair: the common name of the client certificate the
    server saw."""
    left, right = socket.socketpair()
    with left, right, ThreadPoolExecutor(1) as pool:
        left.settimeout(10)
        right.settimeout(10)
        served = pool.submit(server.wrap_socket, left, server_side=True)
        with client.wrap_socket(right, server_hostname=name), served.result(timeout=10) as tls:
            peer = tls.getpeercert()
    assert peer, "the server saw no client certificate"
    subject = peer["subject"]
    assert isinstance(subject, tuple)
    [common_name] = [pair[1] for rdn in subject for pair in rdn if pair[0] == "commonName"]
    return common_name


@pytest.mark.parametrize("namespace", [NAMESPACE, "gpu-system"])
def test_helm_made_certificates_serve_the_extender_and_the_scheduler(tmp_path: Path, namespace: str) -> None:
    """extender.tls.create: the Secrets make-certs.sh would make. The extender's own TLS code
    serves with them, and kube-scheduler's client certificate passes its client CA, for the
    Service's name and each extra SAN."""
    docs = template(
        *SWITCHES["scheduler"],
        *("--set", "extender.tls.create=true"),
        *_json("extender.tls.extraSANs", ["10.96.0.10", "vcuda-extender.example.com"]),
        namespace=namespace,
    )
    files: dict[str, dict[str, Path]] = {}
    for name in ("vcuda-extender-tls", "vcuda-extender-client"):
        secret = one(docs, "Secret", name)
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        files[name] = {}
        for item, value in secret["data"].items():
            files[name][item] = tmp_path / f"{name}-{item}"
            files[name][item].write_bytes(base64.b64decode(value))
    # Where the pods look for them: the Deployment's flags and the scheduler's tlsConfig.
    settings = extender_settings_from(extender_args(docs))
    server_files = files["vcuda-extender-tls"]
    assert settings.tls_cert is not None and PurePosixPath(settings.tls_cert).name == "tls.crt"
    server = server_context(
        replace(
            settings,
            tls_cert=server_files["tls.crt"],
            tls_key=server_files["tls.key"],
            client_ca=server_files["ca.crt"],
        )
    )
    assert server is not None
    tls_config = yaml.safe_load(
        one(docs, "ConfigMap", "vcuda-scheduler-config")["data"]["scheduler-config.yaml"]
    )["extenders"][0]["tlsConfig"]
    assert {PurePosixPath(tls_config[k]).name for k in ("certFile", "keyFile", "caFile")} == set(
        files["vcuda-extender-client"]
    )
    client_files = files["vcuda-extender-client"]
    client = ssl.create_default_context(cafile=str(client_files["ca.crt"]))
    client.load_cert_chain(client_files["tls.crt"], client_files["tls.key"])
    for name in (f"vcuda-extender.{namespace}.svc", "10.96.0.10", "vcuda-extender.example.com"):
        assert _handshake(server, client, name) == "vcuda-scheduler"
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, "vcuda-extender.elsewhere.svc")


def test_notes_say_how_to_check_the_install() -> None:
    out = run_helm("install", "vcuda-agent", str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "kubectl -n kube-system get pods -l app.kubernetes.io/name=vcuda-agent" in notes
    assert (
        "nvidia.com/vcuda-core" in notes
        and "kubectl label node <gpu-node> nvidia-device-enable=enable" in notes
    )
    [status] = re.findall(r"exec \$POD -- (vcuda-agent .+)", notes)
    assert build_parser().parse_args(status.split()[1:]).command == "status"
    assert "deploy/extender-tls/make-certs.sh --apply" in notes


# ---- bad values ----------------------------------------------------------------------------------

SCHEMA_ERROR = (
    "values don't meet the specifications of the schema(s) in the following chart(s):\nvcuda-agent:"
)


BAD_VALUES: list[tuple[tuple[str, ...], str]] = [
    (("--set", "metrics.port=abc"), "- at '/metrics/port': got string, want integer"),
    (("--set", "metrics.port=70000"), "- at '/metrics/port': maximum: got 70,000, want 65,535"),
    (
        ("--set", "image.pullPolicy=Sometimes"),
        "- at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    (
        ("--set", "scheduler.image.pullPolicy=always"),
        "- at '/scheduler/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    (
        ("--set", "deviceListStrategy=volume-mounts"),
        "- at '/deviceListStrategy': value must be one of 'mounts', 'envvar', 'cdi'",
    ),
    (("--set", "mps.sharingMode=freezer"), "- at '/mps/sharingMode': value must be one of 'auto', 'mps'"),
    (("--set", "metrics.auth=token"), "- at '/metrics/auth': value must be one of 'kubernetes', 'none'"),
    (("--set-string", "extender.tls.create=yes"), "- at '/extender/tls/create': got string, want boolean"),
    (("--set", "dra.gpus=first"), "- at '/dra/gpus': 'first' does not match pattern"),
    (("--set", "image.repository="), "- at '/image/repository': minLength: got 0, want 1"),
    (
        ("--set", "monitoring.serviceMonitor.interval=15"),
        "- at '/monitoring/serviceMonitor/interval': got number, want string",
    ),
    (
        ("--set", "tolerations[0].operator=Sometimes"),
        "- at '/tolerations/0/operator': value must be one of 'Exists', 'Equal'",
    ),
    (("--set", "resorces.limits.memory=1Gi"), "- at '': additional properties 'resorces' not allowed"),
    (
        _json("config.nodeConfig", [{"name": "gpu-node-1", "deviceMemoryScaling": 2}]),
        "- at '/config/nodeConfig/0/deviceMemoryScaling': maximum: got 2, want 1",
    ),
    (
        _json("config.nodeConfig", [{"deviceMemoryScaling": 0.5}]),
        "- at '/config/nodeConfig/0': missing property 'name'",
    ),
    (
        _json("config.nodeConfig", [{"name": "gpu-node-1", "cgroupDriver": "system"}]),
        "- at '/config/nodeConfig/0/cgroupDriver': value must be one of 'systemd', 'cgroupfs'",
    ),
    (
        _json("config.nodeConfig", [{"name": "gpu-node-1", "memoryScaling": 0.5}]),
        "- at '/config/nodeConfig/0': additional properties 'memoryScaling' not allowed",
    ),
    (
        _json("config.nodeConfig", [{"name": "GPU_Node"}]),
        "- at '/config/nodeConfig/0/name': 'GPU_Node' does not match pattern",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_VALUES, ids=[a[-1][:48] for a, _ in BAD_VALUES])
def test_bad_values_are_refused_by_the_schema(args: tuple[str, ...], message: str) -> None:
    error = template_error(*args)
    assert SCHEMA_ERROR in error and message in error, error


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--set", "scheduler.enabled=true,extender.enabled=false"),
            "scheduler.enabled needs extender.enabled: vcuda-scheduler calls the extender",
        ),
        (
            ("--set", "dra.enabled=true", "--kube-version", "1.33.4"),
            "dra.enabled needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is v1.33.4",
        ),
        (
            _json("config.nodeConfig", [{"name": "a"}, {"name": "a"}]),
            'config.nodeConfig lists node "a" twice',
        ),
        (
            _json("extender.tls.extraSANs", ["10.96.0.10"]),
            "extender.tls.extraSANs is used only with extender.tls.create: true",
        ),
        (
            ("--kube-version", "1.29.0"),
            "chart requires kubeVersion: >=1.30.0-0 which is incompatible with Kubernetes v1.29.0",
        ),
    ],
    ids=[
        "scheduler-without-extender",
        "dra-before-1.34",
        "node-twice",
        "sans-without-create",
        "kubernetes-1.29",
    ],
)
def test_combinations_the_chart_cannot_serve_are_refused(args: tuple[str, ...], message: str) -> None:
    assert message in template_error(*args)


def test_helm_install_refuses_bad_values_too() -> None:
    out = run_helm(
        "install",
        "vcuda-agent",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        NAMESPACE,
        "--set",
        "image.pullPolicy=Sometimes",
    )
    assert out.returncode != 0
    assert SCHEMA_ERROR in out.stderr and "'/image/pullPolicy': value must be one of" in out.stderr
