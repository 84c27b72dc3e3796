"""``vcuda-agent``: argument parsing and dispatch to the subcommands.

The production commands (``run``, ``status``, ``extender``) are imported here; the demo and
the simulated node's commands are declared in :mod:`.simcommands` and imported only when
they run, so that ``vcuda-agent run`` on a real node loads no simulator, emulator or demo."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from agent import __version__
from agent.settings import (
    DEFAULT_BPF_DIR,
    DEFAULT_PLUGIN_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    ActuatorMode,
    DeviceListStrategy,
    DraSettings,
    EnforcementSettings,
    Feedback,
    GuardMode,
    MemoryQuotaMode,
    MetricsAuth,
    SharingMode,
    SharingSettings,
)
from agent.surfaces.cli import extender, run, simcommands, status
from agent.surfaces.cli.common import common_options, configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcuda-agent",
        description="Kubernetes node agent that shares NVIDIA GPUs between pods "
        "(nvidia.com/vcuda-core, nvidia.com/vcuda-memory) with limits enforced from outside the workload.",
        epilog="Start with `vcuda-agent demo` to see a simulated 2-GPU node at work.",
    )
    parser.add_argument("--version", action="version", version=f"vcuda-agent {__version__}")
    common = common_options()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("run", parents=[common], help="run the node agent", description=run.__doc__)
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME, else the host name)")
    p.add_argument(
        "--simulate",
        metavar="SPEC",
        help="simulate GPUs instead of NVML, e.g. 2xH100-80GB or 1xA100-40GB,1xT4-16GB",
    )
    p.add_argument(
        "--device-plugin-dir",
        type=str,
        default=str(DEFAULT_PLUGIN_DIR),
        metavar="DIR",
        help=f"kubelet's device-plugin directory (default {DEFAULT_PLUGIN_DIR})",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="node config JSON (ConfigMap gpu-manager-config, key config.json)",
    )
    p.add_argument(
        "--metrics-address",
        default="0.0.0.0:5678",
        metavar="HOST:PORT",
        help="serve /metrics, /healthz, /readyz here (port 0: any free port; default 0.0.0.0:5678)",
    )
    p.add_argument("--no-metrics", action="store_true", help="do not serve metrics")
    p.add_argument(
        "--legacy-metrics",
        action="store_true",
        help="also serve gpu-manager's metric names (container_gpu_utilization...) for migrating dashboards",
    )
    p.add_argument(
        "--metrics-auth",
        choices=[a.value for a in MetricsAuth],
        default=MetricsAuth.NONE.value,
        help="who may read /metrics: none (anyone who reaches the port; default) or kubernetes (a "
        "bearer token the API server authenticates, for a user RBAC allows to get the "
        "non-resource URL /metrics; the DaemonSet's choice). /healthz and /readyz stay open",
    )
    p.add_argument("--metrics-tls-cert", metavar="PATH", help="serve the metrics port over HTTPS (PEM)")
    p.add_argument("--metrics-tls-key", metavar="PATH", help="the certificate's private key (PEM)")
    p.add_argument(
        "--no-kube",
        action="store_true",
        help="run without the Kubernetes API: device plugin, metrics and enforcement only",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig for the Kubernetes API (default: the in-cluster service account)",
    )
    p.add_argument(
        "--pod-resources-socket",
        default=str(DEFAULT_POD_RESOURCES_SOCKET),
        metavar="PATH",
        help=f"kubelet's pod-resources API (default {DEFAULT_POD_RESOURCES_SOCKET})",
    )
    p.add_argument(
        "--device-list-strategy",
        choices=[s.value for s in DeviceListStrategy],
        default="mounts",
        help="mounts: device nodes + host driver files in /usr/bin and the library dirs (plain runc); "
        "envvar: NVIDIA_VISIBLE_DEVICES for the NVIDIA runtime; cdi: CDI names nvidia.com/gpu=<uuid>",
    )
    p.add_argument(
        "--driver-root",
        default="/",
        metavar="DIR",
        help="host path holding the NVIDIA driver files and /dev (default /)",
    )
    p.add_argument(
        "--driver-root-in-agent",
        metavar="DIR",
        help="where this process sees --driver-root, when it runs in a container (default: the same)",
    )
    p.add_argument(
        "--ignored-xids",
        metavar="LIST",
        help="XIDs that do not make a GPU Unhealthy (default 13,31,43,45,68,109)",
    )
    p.add_argument(
        "--device-guard",
        choices=[m.value for m in GuardMode],
        default=GuardMode.ENFORCE.value,
        help="NVIDIA device rules per container: enforce (default), audit (log/count only), off",
    )
    p.add_argument(
        "--own-pod-uid",
        metavar="UID",
        help="the agent's own pod, which the device guard leaves alone (default: $POD_UID)",
    )
    p.add_argument(
        "--guard-exempt-namespaces",
        metavar="NS[,NS]",
        default="",
        help="namespaces (the admin's, e.g. a DCGM exporter's) where a pod annotated "
        "nvidia.com/vcuda-device-guard: exempt is left alone; elsewhere the annotation is refused "
        "(default: none)",
    )
    p.add_argument(
        "--cgroup-root", default="/sys/fs/cgroup", metavar="DIR", help="cgroup mount (default /sys/fs/cgroup)"
    )
    p.add_argument(
        "--kubelet-config",
        default="/var/lib/kubelet/config.yaml",
        metavar="FILE",
        help="kubelet's config file, for cgroupDriver (default /var/lib/kubelet/config.yaml)",
    )
    p.add_argument(
        "--host-root",
        default="/",
        metavar="DIR",
        help="where the host's / is seen, to find the container runtime's socket (default /; /host in a pod)",
    )
    p.add_argument(
        "--nvidia-toolkit-config",
        action="append",
        default=[],
        metavar="FILE",
        help="the NVIDIA container toolkit's config.toml, checked for the NVIDIA_VISIBLE_DEVICES hole "
        "(repeatable; default: etc/nvidia-container-runtime/config.toml and the GPU operator's "
        "usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml under --host-root)",
    )
    p.add_argument("--no-ioctl-tracing", action="store_true", help="no eBPF ioctl tracer: NVML alone")
    p.add_argument(
        "--bpf-dir",
        default=str(DEFAULT_BPF_DIR),
        metavar="DIR",
        help="where ioctl_tracer.c and device_guard.c are (default: the bpf/ directory of this install)",
    )
    p.add_argument(
        "--dump-bpf",
        action="store_true",
        help="print the generated BPF programs (ioctl tracer, device guard) and exit",
    )
    _add_enforcement_options(p)
    _add_dra_options(p)
    simcommands.add_sim_state_dir(p)
    p.set_defaults(func=run.main)

    simcommands.add_demo_parser(sub, common)
    simcommands.add_parsers(sub, common)
    status.add_parser(sub, common)
    extender.add_parser(sub, common)
    return parser


def _add_enforcement_options(p: argparse.ArgumentParser) -> None:
    defaults = EnforcementSettings()
    g = p.add_argument_group("enforcement (compute caps, memory quotas)")
    g.add_argument(
        "--no-enforcement",
        action="store_true",
        help="measure and report only: never freeze a container or kill a process",
    )
    g.add_argument(
        "--control-period",
        type=float,
        default=defaults.period_s,
        metavar="S",
        help=f"control period in seconds: measure, set duties, act (default {defaults.period_s})",
    )
    g.add_argument(
        "--control-feedback",
        choices=[f.value for f in Feedback],
        default=defaults.feedback.value,
        help="what a container's use is measured from: device (the GPU's own utilization samples, "
        "attributed by whom the agent kept thawed when: turns; default) or nvml (NVML's per-process "
        "samples: duty cycles, as before; to compare)",
    )
    g.add_argument(
        "--control-cycle",
        type=float,
        default=defaults.cycle_s,
        metavar="S",
        help=f"turns: the longest cycle; each held container takes a turn in it (default {defaults.cycle_s})",
    )
    g.add_argument(
        "--control-max-wait",
        type=float,
        default=defaults.max_wait_s,
        metavar="S",
        help="turns: the longest a held container waits frozen for its next turn; work per submission "
        f"too long to be paid for within it is reported as not holdable (default {defaults.max_wait_s})",
    )
    g.add_argument(
        "--control-window",
        type=float,
        default=defaults.window_s,
        metavar="S",
        help="duty cycles: a container is measured over at least this many seconds of samples "
        f"(default {defaults.window_s})",
    )
    g.add_argument(
        "--control-gain",
        type=float,
        default=defaults.gain,
        metavar="G",
        help=f"duty cycles: share of an error within 10 pp one update corrects (default {defaults.gain})",
    )
    g.add_argument(
        "--control-max-cycle",
        type=float,
        default=defaults.max_cycle_s,
        metavar="S",
        help="duty cycles: the longest cycle, for work that drains long after a freeze "
        f"(default {defaults.max_cycle_s})",
    )
    g.add_argument(
        "--control-idle-hold",
        type=float,
        default=defaults.idle_hold_s,
        metavar="S",
        help=f"an idle held container stays held this long (default {defaults.idle_hold_s})",
    )
    g.add_argument(
        "--actuator",
        choices=[m.value for m in ActuatorMode],
        default=defaults.actuator.value,
        help="how a container is paused: auto (freezer where writable, else signals; default), "
        "freezer, signals",
    )
    g.add_argument(
        "--memory-quota-mode",
        choices=[m.value for m in MemoryQuotaMode],
        default=defaults.memory_mode.value,
        help="over its vcuda-memory: kill the process that went over (default), deny the allocation "
        "(BPF LSM kernels only; else kill), audit (report only)",
    )
    g.add_argument(
        "--memory-check",
        type=float,
        default=defaults.memory_check_s,
        metavar="S",
        help=f"GPU memory is compared with the quotas every S seconds (default {defaults.memory_check_s})",
    )
    g.add_argument(
        "--memory-check-near",
        type=float,
        default=defaults.memory_check_near_s,
        metavar="S",
        help="... and every S seconds while a container is near its quota and growing; 0: never faster "
        f"(default {defaults.memory_check_near_s})",
    )
    g.add_argument(
        "--state-dir",
        default=str(defaults.state_dir),
        metavar="DIR",
        help=f"freeze journal and status socket (default {defaults.state_dir}; a hostPath in the DaemonSet)",
    )
    sharing = SharingSettings()
    g.add_argument(
        "--sharing-mode",
        choices=[m.value for m in SharingMode],
        default=sharing.mode.value,
        help="how shares of a GPU are held: freezer (duty cycles; default), mps (an MPS control daemon "
        "per shared GPU, per-client limits, duty cycles on top), auto (mps where it can run); "
        "the node config's sharingMode overrides it",
    )
    g.add_argument(
        "--mps-control",
        metavar="COMMAND",
        help="the MPS control daemon's command line, run as given per GPU, in the foreground "
        "(default: nvidia-cuda-mps-control -f; with --simulate, the simulator's stand-in)",
    )
    g.add_argument(
        "--mps-advisory-limits",
        action="store_true",
        help="use MPS limits even where a tenant can lift them (its own CUDA_MPS_* environment, "
        "the control socket every client reaches: every driver so far); trusted tenants only. "
        "Without it those shares are held by the freezer. The node config's mpsAdvisoryLimits "
        "overrides it",
    )
    g.add_argument(
        "--mps-root",
        default=str(sharing.mps_root),
        metavar="DIR",
        help=f"host directory of the daemons' pipe and log directories (default {sharing.mps_root})",
    )
    g.add_argument(
        "--no-watchdog",
        action="store_true",
        help="no watchdog process (it thaws every container the agent froze if the agent dies)",
    )


def _add_dra_options(p: argparse.ArgumentParser) -> None:
    defaults = DraSettings()
    g = p.add_argument_group("DRA driver gpu.vcuda.io (docs/dra.md)")
    g.add_argument(
        "--dra",
        action="store_true",
        help="also serve claims as the DRA driver gpu.vcuda.io: publish a ResourceSlice, prepare claims "
        "for kubelet, hold them like device-plugin shares",
    )
    g.add_argument(
        "--dra-gpus",
        default="all",
        metavar="LIST",
        help="the GPU indexes handed to DRA, e.g. 2,3 (default all); the device plugin offers the others",
    )
    g.add_argument(
        "--dra-registry-dir",
        default=str(defaults.registry_dir),
        metavar="DIR",
        help=f"kubelet's plugin registry (default {defaults.registry_dir})",
    )
    g.add_argument(
        "--dra-plugin-dir",
        default=str(defaults.plugin_dir),
        metavar="DIR",
        help=f"where the DRA service socket is served (default {defaults.plugin_dir})",
    )
    g.add_argument(
        "--cdi-dir",
        default=str(defaults.cdi_dir),
        metavar="DIR",
        help=f"where prepared claims' CDI specs are written (default {defaults.cdi_dir})",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    code: int = args.func(args)
    return code
