"""deploy/: each kustomization builds with the real kubectl, every object is a valid Kubernetes
object (strict schemas), and the DaemonSet is what the agent actually needs: args its CLI
accepts, every path it uses mounted (writable where it writes), probes on its metrics port,
a node config its loader accepts, and the RBAC exactly as written in deploy/base/rbac.yaml.
The DRA overlay runs the agent as the driver gpu.vcuda.io with every directory kubelet and the
runtime share with it mounted at its own host path."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from agent.domain.nodeconfig import load_config
from agent.settings import (
    DEFAULT_CDI_DIR,
    DEFAULT_DRA_PLUGIN_DIR,
    DEFAULT_PLUGINS_REGISTRY,
    DeviceListStrategy,
    MetricsAuth,
    Settings,
    SharingMode,
)
from agent.surfaces.cli.run import settings_from_args
from tests.integration.deploy_render import (
    AGENT,
    KUSTOMIZATIONS,
    Doc,
    check_service_monitor,
    container,
    dra_directory_flags,
    load_yaml,
    mount_for,
    one,
    parse_run_args,
    render,
    validate,
    validator,
)

BASE_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"}
# The scheduler extender (deploy/base/extender.yaml) and its second scheduler's overlay.
BASE_KINDS |= {"Deployment", "Service"}
# The node agent's node-scoped rights (deploy/base/node-scope-policy.yaml).
BASE_KINDS |= {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
OVERLAY_KINDS = {
    "monitoring": {"ServiceMonitor", "Secret"},
    "scheduler": {"RoleBinding", "NetworkPolicy"},
    "dra": {"DeviceClass"},
}


def agent_settings(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What `vcuda-agent run` builds from the DaemonSet's args and downward-API env."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    monkeypatch.setenv("POD_UID", "0b5e3c6a-1d2f-4e5a-9b8c-7d6e5f4a3b2c")
    return settings_from_args(parse_run_args(container(one(docs, *AGENT))["args"]))


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_each_kustomization_builds_and_validates_strictly(directory: str) -> None:
    docs = render(directory)
    kinds = {d["kind"] for d in docs}
    extra = OVERLAY_KINDS.get(directory.rsplit("/", 1)[-1], set())
    assert kinds == BASE_KINDS | extra
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            check_service_monitor(doc, one(docs, "Service", "vcuda-agent-metrics"))
        else:
            validate(doc)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    """Strict validation is what makes the test above worth having: an unknown field fails."""
    daemonset = copy.deepcopy(one(render("deploy"), *AGENT))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    kv = validator()
    with pytest.raises(kv.ValidationError):
        kv.validate(daemonset, "1.30", strict=True)


@pytest.mark.parametrize(
    ("directory", "strategy"),
    [
        ("deploy", DeviceListStrategy.MOUNTS),
        ("deploy/overlays/cdi", DeviceListStrategy.CDI),
        ("deploy/overlays/dra", DeviceListStrategy.MOUNTS),
    ],
)
def test_the_agent_cli_accepts_the_daemonset_args(
    directory: str, strategy: DeviceListStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(directory)
    agent = container(one(docs, *AGENT))
    assert "command" not in agent, "args follow the image's ENTRYPOINT (vcuda-agent run)"
    settings = agent_settings(docs, monkeypatch)
    assert settings.node_name == "gpu-node-1"
    assert settings.cgroups.own_pod_uid.startswith("0b5e3c6a")
    assert settings.use_kube and settings.kube.kubeconfig is None, "in-cluster service account"
    assert settings.plugin.device_list_strategy is strategy
    assert settings.config_file == Path("/etc/vcuda-agent/config.json")
    assert settings.plugin.driver_root == Path("/")
    assert settings.plugin.driver_root_in_agent == Path("/host")
    assert settings.bpf.bpf_dir == Path("/opt/vcuda-agent/bpf")
    assert settings.metrics.enabled and settings.metrics.host == "0.0.0.0"
    assert settings.metrics.auth is MetricsAuth.KUBERNETES, "the node's port serves pod names: a token"


def test_the_mps_overlay_runs_the_host_drivers_daemon_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = agent_settings(render("deploy/overlays/mps"), monkeypatch)
    assert settings.sharing.mode is SharingMode.AUTO
    assert settings.sharing.mps_control == ("chroot", "/host", "nvidia-cuda-mps-control", "-f")
    assert settings.sharing.mps_root.is_relative_to(settings.enforcement.state_dir)  # on the state hostPath
    assert agent_settings(render("deploy"), monkeypatch).sharing.mode is SharingMode.FREEZER


def test_every_path_the_agent_uses_is_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("deploy")
    agent = container(one(docs, *AGENT))
    mounts = agent["volumeMounts"]
    volumes = {v["name"]: v for v in one(docs, *AGENT)["spec"]["template"]["spec"]["volumes"]}
    settings = agent_settings(docs, monkeypatch)
    written = {  # the agent creates or writes files here
        "device-plugin dir": settings.plugin.directory,
        "cgroup root": settings.cgroups.root,
        "freeze journal": settings.enforcement.journal_path,
        "status socket": settings.enforcement.status_socket,
        "tracefs": Path("/sys/kernel/tracing"),
        "device nodes": Path("/dev/nvidiactl"),  # NVML opens them read-write
    }
    read = {
        "pod-resources socket": settings.kube.pod_resources_socket,
        "kubelet config": settings.cgroups.kubelet_config,
        "node config": settings.config_file,
        "driver root": settings.plugin.driver_root_in_agent,
        "kernel modules": Path("/lib/modules"),
        "kernel headers": Path("/usr/src"),
    }
    for what, path in {**written, **read}.items():
        assert path is not None
        mount = mount_for(PurePosixPath(path), mounts)
        assert mount is not None, f"{what} {path} is not in any volume"
        if what in written:
            assert not mount.get("readOnly", False), f"{what} {path} is mounted read-only"
    # The journal must outlive the pod: a host directory, so a restarted agent thaws what a
    # crashed one froze.
    state = mount_for(PurePosixPath(settings.enforcement.journal_path), mounts)
    assert state is not None
    assert volumes[state["name"]]["hostPath"] == {"path": "/run/vcuda-agent", "type": "DirectoryOrCreate"}
    # The image's BPF sources must not be hidden by a volume.
    assert mount_for(PurePosixPath(settings.bpf.bpf_dir), mounts) is None


@pytest.mark.parametrize("directory", ["deploy", "deploy/overlays/dra"])
def test_volume_mounts_and_volumes_match_one_to_one(directory: str) -> None:
    daemonset = one(render(directory), *AGENT)
    mounts = container(daemonset)["volumeMounts"]
    volumes = daemonset["spec"]["template"]["spec"]["volumes"]
    mounted = [m["name"] for m in mounts]
    declared = [v["name"] for v in volumes]
    assert len(set(mounted)) == len(mounted) and len(set(declared)) == len(declared)
    assert set(mounted) == set(declared), "every mount has a volume, every volume is mounted"
    host_paths = {v["hostPath"]["path"]: v["hostPath"].get("type") for v in volumes if "hostPath" in v}
    assert host_paths["/"] == "Directory"
    root = next(m for m in mounts if m["mountPath"] == "/host")
    assert root["readOnly"] and root["mountPropagation"] == "HostToContainer"
    # Not mounted on purpose: /run (it would shadow the service-account token's mount point at
    # /var/run/secrets) and /proc (hostPID already shows the host's processes).
    assert not {"/run", "/var/run", "/proc"} & {m["mountPath"] for m in mounts}


def test_the_dra_overlay_runs_the_agent_as_the_dra_driver_of_every_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = render("deploy/overlays/dra")
    dra = agent_settings(docs, monkeypatch).dra
    assert dra.enabled
    assert dra.gpus is None, "--dra-gpus all: the overlay's documented choice (docs/dra.md, Install)"
    assert (dra.registry_dir, dra.plugin_dir, dra.cdi_dir) == (
        DEFAULT_PLUGINS_REGISTRY,
        DEFAULT_DRA_PLUGIN_DIR,
        DEFAULT_CDI_DIR,
    )
    assert not agent_settings(render("deploy"), monkeypatch).dra.enabled, "the base stays a device plugin"
    # The overlay only appends: the base's args come first, unchanged.
    base_args = container(one(render("deploy"), *AGENT))["args"]
    assert container(one(docs, *AGENT))["args"][: len(base_args)] == base_args
    # Its ClusterRole is bound to the ServiceAccount the DaemonSet runs as.
    pod = one(docs, *AGENT)["spec"]["template"]["spec"]
    binding = one(docs, "ClusterRoleBinding", "vcuda-agent-dra")
    assert binding["roleRef"]["name"] == "vcuda-agent-dra"
    subject = {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "kube-system"}
    assert subject in binding["subjects"]


def dra_mount_problems(daemonset: Doc) -> list[str]:
    """Why a DRA directory of the agent (each --dra-*-dir and --cdi-dir, as its args set them)
    is not the host directory of the same path: kubelet dials the registration and DRA sockets
    at the paths the agent reports, and the runtime reads the CDI specs on the host. Empty when
    every one is a writable hostPath mounted at its own path."""
    mounts = container(daemonset)["volumeMounts"]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    args = parse_run_args(container(daemonset)["args"])
    problems = []
    for flag, dest in dra_directory_flags().items():
        path = PurePosixPath(getattr(args, dest))
        mount = mount_for(path, mounts)
        if mount is None:
            problems.append(f"{flag} {path} is not in any volume")
            continue
        host = volumes.get(mount["name"], {}).get("hostPath")
        if host is None:
            problems.append(f"{flag} {path} is in volume {mount['name']}, not a hostPath")
            continue
        seen_at = PurePosixPath(host["path"]) / path.relative_to(mount["mountPath"])
        if seen_at != path:
            problems.append(f"{flag} {path} is the host's {seen_at}")
        if mount.get("readOnly", False):
            problems.append(f"{flag} {path} is mounted read-only")
    return problems


def test_every_dra_directory_is_mounted_at_its_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("deploy/overlays/dra")
    daemonset = one(docs, *AGENT)
    assert set(dra_directory_flags()) >= {"--dra-registry-dir", "--dra-plugin-dir", "--cdi-dir"}
    assert dra_mount_problems(daemonset) == []
    # Created on first use: no driver has made its plugin directory on a fresh node, and a
    # runtime that never saw a dynamic CDI spec has no /var/run/cdi.
    dra = agent_settings(docs, monkeypatch).dra
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    for directory in (dra.registry_dir, dra.plugin_dir, dra.cdi_dir):
        mount = mount_for(PurePosixPath(directory), container(daemonset)["volumeMounts"])
        assert mount is not None and mount["mountPath"] == str(directory)
        assert volumes[mount["name"]]["hostPath"] == {"path": str(directory), "type": "DirectoryOrCreate"}
    # Prepared claims are checkpointed where a restarted agent finds them: the state hostPath.
    state = mount_for(PurePosixPath(dra.checkpoint_dir), container(daemonset)["volumeMounts"])
    assert state is not None and not state.get("readOnly", False)
    assert volumes[state["name"]]["hostPath"]["path"] == "/run/vcuda-agent"


def _named(items: list[Doc], name: str) -> Doc:
    return next(i for i in items if i["name"] == name)


def _unmount_cdi(pod: Doc) -> None:
    pod["containers"][0]["volumeMounts"].remove(_named(pod["containers"][0]["volumeMounts"], "cdi"))


@pytest.mark.parametrize(
    ("break_it", "problem"),
    [
        (_unmount_cdi, "--cdi-dir /var/run/cdi is not in any volume"),
        (
            lambda pod: _named(pod["volumes"], "cdi")["hostPath"].update(path="/etc/cdi"),
            "--cdi-dir /var/run/cdi is the host's /etc/cdi",
        ),
        (
            lambda pod: _named(pod["containers"][0]["volumeMounts"], "plugins-registry").update(
                mountPath="/plugins_registry"
            ),
            "--dra-registry-dir /var/lib/kubelet/plugins_registry is not in any volume",
        ),
        (
            lambda pod: _named(pod["volumes"], "dra-plugin").update(hostPath=None, emptyDir={}),
            "--dra-plugin-dir /var/lib/kubelet/plugins/gpu.vcuda.io is in volume dra-plugin, not a hostPath",
        ),
        (
            lambda pod: _named(pod["containers"][0]["volumeMounts"], "dra-plugin").update(readOnly=True),
            "--dra-plugin-dir /var/lib/kubelet/plugins/gpu.vcuda.io is mounted read-only",
        ),
        (
            lambda pod: pod["containers"][0]["args"].extend(["--cdi-dir", "/etc/cdi"]),
            "--cdi-dir /etc/cdi is not in any volume",
        ),
    ],
)
def test_the_dra_mount_check_catches_a_directory_mounted_elsewhere(
    break_it: Callable[[Doc], object], problem: str
) -> None:
    daemonset = copy.deepcopy(one(render("deploy/overlays/dra"), *AGENT))
    break_it(daemonset["spec"]["template"]["spec"])
    assert problem in dra_mount_problems(daemonset)


def test_host_namespaces_privileges_placement_and_lifecycle() -> None:
    docs = render("deploy")
    daemonset = one(docs, *AGENT)
    assert daemonset["metadata"]["namespace"] == "kube-system"
    spec = daemonset["spec"]
    pod = spec["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"] == {"nvidia-device-enable": "enable"}
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["terminationGracePeriodSeconds"] == 30
    account = one(docs, "ServiceAccount", pod["serviceAccountName"])
    assert account["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    agent = container(daemonset)
    assert agent["securityContext"] == {"privileged": True}
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    resources = agent["resources"]
    assert "cpu" not in resources["limits"], "a CPU-throttled agent stretches the duty cycles"
    assert resources["requests"]["cpu"] == "100m"
    # bench/footprint.py: agent 110 MB with 128 containers + watchdog 15 MB; the BPF loader
    # child peaks at 134 MB for a second or two at start-up, in the same memory cgroup.
    steady, start_up = 110 + 15, 110 + 15 + 134
    assert _mib(resources["requests"]["memory"]) >= steady * 1.5
    assert _mib(resources["limits"]["memory"]) >= 1.5 * start_up


def test_the_probes_point_at_the_metrics_port(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("deploy")
    agent = container(one(docs, *AGENT))
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    port = agent_settings(docs, monkeypatch).metrics.port
    assert ports["metrics"] == port == 5678
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = agent[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == port, f"{probe} probes another port"
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    startup = agent["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60, "start-up may take 30 s or more"


def test_the_config_map_holds_a_node_config_the_agent_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render("deploy")
    config_map = one(docs, "ConfigMap", "gpu-manager-config")
    assert config_map["metadata"]["namespace"] == "kube-system"
    assert set(config_map["data"]) == {"config.json"}
    path = tmp_path / "config.json"
    path.write_text(config_map["data"]["config.json"])
    node = load_config(path).for_node("gpu-node-1")  # raises ConfigError listing any problem
    assert (node.device_memory_scaling, node.cgroup_driver) == (1.0, "systemd")
    # Mounted as a directory (not subPath) so edits reach the agent, which re-reads the file.
    daemonset = one(docs, *AGENT)
    config_file = agent_settings(docs, monkeypatch).config_file
    assert config_file is not None
    mount = mount_for(PurePosixPath(config_file), container(daemonset)["volumeMounts"])
    assert mount is not None and "subPath" not in mount
    assert PurePosixPath(config_file) == PurePosixPath(mount["mountPath"]) / "config.json"
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "gpu-manager-config"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_the_rbac_is_rendered_exactly_as_written(directory: str) -> None:
    written = load_yaml("deploy/base/rbac.yaml")
    kinds = {d["kind"] for d in written}
    assert kinds == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    names = {(d["kind"], d["metadata"]["name"]) for d in written}
    assert [d for d in render(directory) if (d["kind"], d["metadata"]["name"]) in names] == written


def test_the_monitoring_overlay_scrapes_every_agent() -> None:
    docs = render("deploy/overlays/monitoring")
    service = one(docs, "Service", "vcuda-agent-metrics")
    daemonset = one(docs, *AGENT)
    spec = service["spec"]
    assert spec["clusterIP"] == "None", "headless: one endpoint per node"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= pod_labels.items()
    [port] = spec["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 5678, "metrics")
    assert service["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    monitor = one(docs, "ServiceMonitor", "vcuda-agent")
    check_service_monitor(monitor, service)
    assert [e["interval"] for e in monitor["spec"]["endpoints"]] == ["15s"]


def test_the_monitoring_overlay_scrapes_with_a_token_that_may_get_metrics_and_nothing_else() -> None:
    """The agents ask for a bearer token (--metrics-auth kubernetes): the ServiceMonitor hands
    Prometheus a service-account token Secret in its own namespace, whose account is bound to
    the ClusterRole that allows get /metrics, and to nothing else."""
    docs = render("deploy/overlays/monitoring")
    monitor = one(docs, "ServiceMonitor", "vcuda-agent")
    [endpoint] = monitor["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    secret = one(docs, "Secret", credentials["name"])
    assert secret["metadata"]["namespace"] == monitor["metadata"]["namespace"], "the Operator looks there"
    assert secret["type"] == "kubernetes.io/service-account-token" and credentials["key"] == "token"
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    one(docs, "ServiceAccount", account)
    subject = {"kind": "ServiceAccount", "name": account, "namespace": secret["metadata"]["namespace"]}
    bound = [
        d["roleRef"]["name"]
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and subject in d.get("subjects", [])
    ]
    assert bound == ["vcuda-metrics-reader"]
    reader = one(docs, "ClusterRole", "vcuda-metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert endpoint.get("scheme", "http") == "http", "the agents serve TLS only when given a certificate"


@pytest.mark.parametrize(
    ("path", "name", "cores", "memory", "limit"),
    [
        ("deploy/examples/share-50.yaml", "cuda-share-50", 50, 2048, "50"),
        ("deploy/examples/exclusive-200.yaml", "cuda-exclusive-200", 200, 0, None),
    ],
)
def test_the_example_pods_validate_and_request_what_they_say(
    path: str, name: str, cores: int, memory: int, limit: str | None
) -> None:
    from agent.domain.annotations import parse_core_limit  # noqa: PLC0415
    from agent.domain.requests import check_core_request  # noqa: PLC0415
    from agent.platform.kube.pods import pod_from_json  # noqa: PLC0415

    [pod] = load_yaml(path)
    validate(pod)
    info = pod_from_json({**pod, "metadata": {**pod["metadata"], "uid": "example"}})
    [cuda] = info.containers
    assert info.name == name
    assert cuda.quantity("nvidia.com/vcuda-core") == cores
    assert cuda.quantity("nvidia.com/vcuda-memory") == memory
    check_core_request(cores)  # raises if the request breaks the rule
    assert info.annotations.get("nvidia.com/vcuda-core-limit") == limit
    if limit is not None:
        assert parse_core_limit(limit, cores) == (int(limit), ""), "a valid limit, no Event"
    # The same pod the demo admits (agent/surfaces/cli/demo_pods.yaml).
    demo = one(load_yaml("agent/surfaces/cli/demo_pods.yaml"), "Pod", name)
    assert _strip(pod) == _strip(demo)


def _strip(pod: Doc) -> Any:
    return {"metadata": pod["metadata"], "spec": pod["spec"]}


def _mib(quantity: str) -> float:
    factors = {"Mi": 1.0, "Gi": 1024.0, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for suffix, factor in factors.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2**20
