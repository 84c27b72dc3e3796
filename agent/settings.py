"""The agent's settings: documented dataclasses, built once at start from the CLI.

Nothing else reads the environment or argv; components get the part of the
settings they need.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from agent.domain.dra import DRIVER as DRA_DRIVER
from agent.domain.dutycontrol import Gains
from agent.domain.health import DEFAULT_IGNORED_XIDS
from agent.domain.turns import TurnSettings
from agent.errors import ConfigError

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_SIM_STATE_DIR = Path("/run/vcuda-agent/sim")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_BPF_DIR = Path(__file__).resolve().parents[1] / "bpf"  # the C sources (repo or image path)
DEFAULT_METRICS_PORT = 5678  # gpu-manager's port; 9400 stays free for dcgm-exporter
DEFAULT_STATE_DIR = Path("/run/vcuda-agent")  # freeze journal, status socket (a hostPath in the DaemonSet)
DRA_MIG_RECONCILE_S = 10.0  # dynamic MIG: strays destroyed, MIG mode enabled (control/dramiggrants.py)
MIG_GEOMETRY_RETRY_S = 10.0  # a MIG geometry not applied yet (processes, a reset pending) is tried again
MIG_OFFER_POLL_S = 0.5  # the MIG device plugins look at the MIG state and the config this often
MIG_HOLDINGS_TTL_S = 1.0  # the device guard re-reads which container holds which MIG device after this
MIG_REFRESH_S = 5.0  # how often the MIG inventory (modes, MIG devices) is read again (control/migwatch.py)
MIG_SHARES_RECONCILE_S = 1.0  # isolated shares: instances of gone pods destroyed, MIG mode enabled
MIG_SHARES_CHECKPOINT = "mig-shares.json"  # in --state-dir: which MIG instance serves which share


class DeviceListStrategy(enum.StrEnum):
    """How Allocate hands GPUs to the container."""

    MOUNTS = "mounts"  # device nodes + host driver files in /usr/bin and the library dirs (plain runc)
    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES=<uuids> for the NVIDIA container runtime
    CDI = "cdi"  # CDI device names nvidia.com/gpu=<uuid>


@dataclass(frozen=True)
class DevicePluginSettings:
    """The kubelet device plugin for nvidia.com/vcuda-core."""

    directory: Path = DEFAULT_PLUGIN_DIR  # kubelet's device-plugin dir (kubelet.sock lives here)
    socket_name: str = "vcuda-core.sock"  # our socket, relative to ``directory``
    resource_name: str = "nvidia.com/vcuda-core"
    device_list_strategy: DeviceListStrategy = DeviceListStrategy.MOUNTS
    driver_root: Path = Path("/")  # host path of the NVIDIA driver files and /dev
    driver_root_in_agent: Path | None = None  # where this process sees driver_root (None: the same)
    register_retry_s: float = 5.0  # retry registration this often while kubelet is unreachable
    # The NVIDIA container toolkit's config.toml files to check for the NVIDIA_VISIBLE_DEVICES
    # hole, as this process sees them (None: the usual places under CgroupSettings.host_root).
    toolkit_configs: tuple[Path, ...] | None = None

    @property
    def socket_path(self) -> Path:
        return self.directory / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.directory / "kubelet.sock"


@dataclass(frozen=True)
class HealthSettings:
    """GPU health from XID events."""

    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS  # XIDs that do not make a GPU Unhealthy


@dataclass(frozen=True)
class SimulationSettings:
    """Simulated GPUs (``--simulate``) instead of NVML."""

    spec: str | None = None  # e.g. "2xH100-80GB"; None: use NVML
    state_dir: Path = DEFAULT_SIM_STATE_DIR  # the node's GPU server, shared with sim-workload and sim-event


class MetricsAuth(enum.StrEnum):
    """Who may read /metrics (docs/metrics.md, "Authentication"); /healthz and /readyz are open."""

    NONE = "none"  # anyone who reaches the port (the CLI's default: demo, development)
    KUBERNETES = "kubernetes"  # a bearer token: TokenReview + SubjectAccessReview (the DaemonSet's)


@dataclass(frozen=True)
class MetricsSettings:
    """The HTTP endpoint for /metrics, /healthz and /readyz."""

    host: str = "0.0.0.0"
    port: int = DEFAULT_METRICS_PORT  # 0: any free port
    enabled: bool = True
    legacy: bool = False  # also serve gpu-manager's metric names (--legacy-metrics)
    auth: MetricsAuth = MetricsAuth.NONE
    auth_cache_s: float = 30.0  # a token's decision is reused this long (keyed by its SHA-256)
    review_timeout_s: float = 5.0  # one TokenReview / SubjectAccessReview request
    tls_cert: Path | None = None  # HTTPS with this certificate and key (PEM); None: plain HTTP
    tls_key: Path | None = None


class GuardMode(enum.StrEnum):
    """What the device guard does about containers' access to NVIDIA devices."""

    ENFORCE = "enforce"  # containers reach only their own GPUs; pods without a GPU reach none
    AUDIT = "audit"  # change nothing; log (and on cgroup v2 count) what would be denied
    OFF = "off"


@dataclass(frozen=True)
class CgroupSettings:
    """Where cgroups, kubelet's config and the container runtime are found; the device guard."""

    root: Path = Path("/sys/fs/cgroup")
    mountinfo: Path = Path("/proc/self/mountinfo")
    kubelet_config: Path = Path("/var/lib/kubelet/config.yaml")  # its cgroupDriver, runtime endpoint
    host_root: Path = Path("/")  # where runtime sockets are looked for
    proc_root: Path = Path("/proc")
    device_guard: GuardMode = GuardMode.ENFORCE
    guard_interval_s: float = 2.0  # re-check (and re-attach) device rules this often
    # The gate's full pass over every pod cgroup, beside its inotify watch (which gates a pod
    # the moment its cgroup appears): a backstop for missed events and exemptions that
    # changed. Rarer than the guard's: the guard re-checks each container's own rules (what
    # a runtime's update replaces) every guard_interval_s, and both must allow a device.
    gate_recheck_s: float = 10.0
    own_pod_uid: str = ""  # the agent's own pod: never guarded (it needs /dev/nvidia* for NVML)
    guard_exempt_namespaces: frozenset[str] = frozenset()  # where the exempt annotation counts


@dataclass(frozen=True)
class BpfSettings:
    """eBPF attribution of NVIDIA ioctls to containers, and cn_proc process events."""

    ioctl_tracing: bool = True  # False: NVML alone
    bpf_dir: Path = DEFAULT_BPF_DIR  # ioctl_tracer.c and device_guard.c
    procevents_rescan_s: float = 30.0  # full /proc rescan that repairs events cn_proc dropped
    procevents_fallback_s: float = 1.0  # /proc scan period when cn_proc is unavailable


class ActuatorMode(enum.StrEnum):
    """How a container is paused between its slices of the GPU (turns and duty cycles)."""

    AUTO = "auto"  # the cgroup freezer where its file is writable, else signals
    FREEZER = "freezer"  # v1 freezer.state / v2 cgroup.freeze
    SIGNALS = "signals"  # SIGSTOP/SIGCONT to the container's processes (pid + start time checked)


class MemoryQuotaMode(enum.StrEnum):
    """What the memory guard does when a container holds more GPU memory than its vcuda-memory."""

    KILL = "kill"  # SIGKILL the process that went over, Event GPUMemoryQuotaExceeded
    DENY = "deny"  # BPF LSM refuses the allocation (kernels with BPF LSM active only)
    AUDIT = "audit"  # report only


class Feedback(enum.StrEnum):
    """What the compute-cap loop measures a container's use from."""

    DEVICE = "device"  # turns: device samples attributed through the agent's own thaw record
    NVML = "nvml"  # duty cycles on NVML's per-process samples (how it was before; to compare)


@dataclass(frozen=True)
class EnforcementSettings:
    """Compute caps and memory quotas: the compute-cap loop and the memory guard."""

    enabled: bool = True  # False: measure and report only, never freeze or kill
    # The controller's tuning: each default lives once, in the domain's settings object
    # (agent/domain/turns.py: TurnSettings; agent/domain/dutycontrol.py: Gains), read here.
    period_s: float = Gains.period_s  # the control period: measure, decide, act
    feedback: Feedback = Feedback.DEVICE  # what a container's use is measured from (control/enforcer.py)
    cycle_s: float = TurnSettings.cycle_s  # turns: the longest cycle; each held container takes a turn in it
    max_wait_s: float = TurnSettings.max_wait_s  # turns: nobody held waits frozen longer for its next turn
    # Duty cycles (--control-feedback nvml, and GPUs whose shares run under MPS):
    window_s: float = Gains.window_s  # a container is measured over at least this much sample time
    gain: float = Gains.gain  # share of an error within 10 pp that one update corrects
    min_duty: float = Gains.min_duty  # never below: a capped container always makes some progress
    max_cycle_s: float = Gains.max_cycle_s  # the longest duty cycle (work that drains long earns a long one)
    idle_hold_s: float = Gains.idle_hold_s  # an idle held container stays held this long (both loops)
    actuator: ActuatorMode = ActuatorMode.AUTO
    memory_mode: MemoryQuotaMode = MemoryQuotaMode.KILL
    memory_check_s: float = 0.2  # GPU memory is compared with the quotas this often
    # ... and this often while a container is near its quota and growing (0: never faster;
    # agent/domain/memcadence.py)
    memory_check_near_s: float = 0.01
    # A GPU no container under control uses is read this often (its status and metrics), by
    # the compute-cap loop and the memory check alike: an idle node costs next to nothing.
    idle_read_s: float = 1.0
    state_dir: Path = DEFAULT_STATE_DIR  # freeze journal and status socket
    watchdog: bool = True  # a separate process thaws everything if the agent dies

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "frozen.json"

    @property
    def status_socket(self) -> Path:
        return self.state_dir / "status.sock"


class SharingMode(enum.StrEnum):
    """How shares of one GPU are held (the freezer or MPS); whole GPUs are never limited."""

    FREEZER = "freezer"  # time-slicing, the duty-cycle controller freezes containers over their cap
    MPS = "mps"  # an MPS control daemon per shared GPU, limits per client, the controller on top
    AUTO = "auto"  # mps where the node can run MPS, else freezer


DEFAULT_MPS_ROOT = Path("/run/vcuda-agent/mps")


@dataclass(frozen=True)
class SharingSettings:
    """Sharing mode and the MPS control daemons (the node config's sharingMode overrides mode)."""

    mode: SharingMode = SharingMode.FREEZER
    mps_control: tuple[str, ...] = ()  # daemon command (); empty: the backend's own
    mps_root: Path = DEFAULT_MPS_ROOT  # host path (the same in the agent): <uuid>/pipe, <uuid>/log
    container_pipe_dir: str = "/run/vcuda-mps/pipe"  # where clients see their GPU's pipe directory
    container_log_dir: str = "/run/vcuda-mps/log"
    ready_timeout_s: float = 3.0  # Allocate waits this long for a daemon's control socket
    idle_stop_s: float = 60.0  # a daemon whose GPU holds no share this long is stopped
    # MPS limits a tenant can lift (its own environment, the control socket it must reach) are
    # used only when asked (--mps-advisory-limits, node config mpsAdvisoryLimits): otherwise
    # the freezer holds those shares.
    advisory_limits: bool = False


DEFAULT_PLUGINS_REGISTRY = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_DRA_PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRA_DRIVER
DEFAULT_CDI_DIR = Path("/var/run/cdi")  # CDI's directory for dynamic specs (containerd, CRI-O read it)


@dataclass(frozen=True)
class DraSettings:
    """The kubelet side of the DRA driver gpu.vcuda.io (docs/dra.md): plugin registration, the
    DRA gRPC service and the CDI specs of prepared claims. kubelet dials the DRA socket at the
    path the agent sees, so the DaemonSet mounts these host directories at the same paths."""

    enabled: bool = False  # --dra: serve claims as the DRA driver gpu.vcuda.io
    gpus: frozenset[int] | None = None  # the GPUs handed to DRA (None: all); the device plugin keeps the rest
    registry_dir: Path = DEFAULT_PLUGINS_REGISTRY  # kubelet's plugin watcher dials sockets here
    plugin_dir: Path = DEFAULT_DRA_PLUGIN_DIR  # the DRA service socket
    cdi_dir: Path = DEFAULT_CDI_DIR  # one spec file per prepared claim
    state_dir: Path = DEFAULT_STATE_DIR  # the prepared-claims checkpoint (a directory)
    api_timeout_s: float = 10.0  # reading a ResourceClaim (kubelet allows a call 45 s)

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{DRA_DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def checkpoint_dir(self) -> Path:
        return self.state_dir / "dra-prepared"


@dataclass(frozen=True)
class KubeSettings:
    """The Kubernetes API (pods, node, events) and kubelet's pod-resources API."""

    kubeconfig: Path | None = None  # None: the in-cluster service account (the DaemonSet)
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET  # which pod holds which device IDs
    sync_timeout_s: float = 30.0  # start-up waits this long for the first pod list
    wait_for_pod_s: float = 3.0  # an Allocate (a DRA claim's Event) waits this long for the watch's pod
    recheck_s: float = 5.0  # what kubelet's pod-resources did not answer about is asked again this often
    capacity_check_s: float = 10.0  # vcuda-memory capacity re-checked at least this often
    heartbeat_s: float = 30.0  # the inventory annotation's heartbeat period


@dataclass(frozen=True)
class Settings:
    node_name: str
    use_kube: bool = True  # False with --no-kube: no Kubernetes API at all
    config_file: Path | None = None  # node config JSON (ConfigMap gpu-manager-config)
    config_reload_s: float = 10.0  # how often the config file is re-read
    plugin: DevicePluginSettings = field(default_factory=DevicePluginSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    simulation: SimulationSettings = field(default_factory=SimulationSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    kube: KubeSettings = field(default_factory=KubeSettings)
    cgroups: CgroupSettings = field(default_factory=CgroupSettings)
    bpf: BpfSettings = field(default_factory=BpfSettings)
    enforcement: EnforcementSettings = field(default_factory=EnforcementSettings)
    sharing: SharingSettings = field(default_factory=SharingSettings)
    dra: DraSettings = field(default_factory=DraSettings)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too); port 0 means any free port."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError([f"--metrics-address {text!r}: expected HOST:PORT, e.g. 0.0.0.0:5678"])
    port = int(port_text)
    if port > 65535:
        raise ConfigError([f"--metrics-address {text!r}: port must be 0..65535"])
    return host.strip("[]") or "0.0.0.0", port


def parse_int_set(text: str, what: str) -> frozenset[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if not t.isdigit()]
    if bad:
        raise ConfigError([f"{what}: {', '.join(bad)} are not non-negative integers"])
    return frozenset(int(t) for t in items)


@dataclass(frozen=True)
class ExtenderSettings:
    """The kube-scheduler extender (``vcuda-agent extender``), one per cluster."""

    host: str = "0.0.0.0"
    port: int = 3456  # gpu-admission's port, so its scheduler configs carry over
    kubeconfig: Path | None = None  # None: the pod's service account (in-cluster config)
    node_policy: str = "binpack"  # default node policy: binpack | spread (pods may override)
    gpu_policy: str = "binpack"  # default GPU policy within a node: binpack | spread
    max_per_gpu: int = 16  # containers per GPU at most
    stale_after_s: float = 90.0  # a node whose inventory heartbeat is older is not eligible
    reservation_ttl_s: float = 120.0  # a bind reservation the watch never confirms expires
    # HTTPS: the server's certificate and key, and the CA that signs kube-scheduler's client
    # certificate (the verbs need one). Without them only loopback or allow_plain_http serves.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    allow_plain_http: bool = False  # plain HTTP on a non-loopback address, by explicit choice
    # Pods whose spec.schedulerName is not one of these are never bound (a forged /bind).
    scheduler_names: tuple[str, ...] = ("default-scheduler", "vcuda-scheduler")
    read_timeout_s: float = 10.0  # a request's headers and body, once it has begun
    idle_timeout_s: float = 120.0  # a keep-alive connection between requests
    max_connections: int = 64  # connections served at once; more are closed at accept
