"""Run the node agent: serve the vcuda-core device plugin to kubelet, watch GPU
health, serve metrics. SIGTERM or SIGINT stops it cleanly (exit 0, sockets removed);
SIGHUP re-reads --config at once (it is also re-read every 10 s)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
from pathlib import Path

from agent.domain.nodeconfig import ClusterConfig, load_config
from agent.errors import ConfigError, VcudaError
from agent.platform.bpf.ioctl_tracer import IoctlTracer
from agent.platform.cgroups.devices_v2 import dump_source
from agent.platform.heap import freeze_startup_heap
from agent.platform.signalwait import SignalWaiter
from agent.settings import (
    ActuatorMode,
    BpfSettings,
    CgroupSettings,
    DeviceListStrategy,
    DevicePluginSettings,
    DraSettings,
    EnforcementSettings,
    Feedback,
    GuardMode,
    HealthSettings,
    KubeSettings,
    MemoryQuotaMode,
    MetricsAuth,
    MetricsSettings,
    Settings,
    SharingMode,
    SharingSettings,
    SimulationSettings,
    parse_address,
    parse_int_set,
)
from agent.surfaces.node import NodeAgent

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
EXIT_FAILED = 1


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The one place where argv and the environment become settings."""
    problems: list[str] = []
    host, port = "0.0.0.0", 5678
    try:
        host, port = parse_address(args.metrics_address)
    except ConfigError as err:
        problems += err.problems
    health = HealthSettings()
    if args.ignored_xids is not None:
        try:
            health = HealthSettings(ignored_xids=parse_int_set(args.ignored_xids, "--ignored-xids"))
        except ConfigError as err:
            problems += err.problems
    enforcement = enforcement_from_args(args, problems)
    sharing = sharing_from_args(args, problems)
    dra = dra_from_args(args, problems)
    metrics = metrics_from_args(args, host, port, problems)
    if problems:
        raise ConfigError(problems)
    driver_in_agent = Path(args.driver_root_in_agent) if args.driver_root_in_agent else None
    return Settings(
        node_name=args.node_name or os.environ.get("NODE_NAME") or socket.gethostname(),
        use_kube=not args.no_kube,
        config_file=Path(args.config) if args.config else None,
        plugin=DevicePluginSettings(
            directory=Path(args.device_plugin_dir),
            device_list_strategy=DeviceListStrategy(args.device_list_strategy),
            driver_root=Path(args.driver_root),
            driver_root_in_agent=driver_in_agent,
            toolkit_configs=tuple(Path(p) for p in args.nvidia_toolkit_config) or None,
        ),
        health=health,
        simulation=SimulationSettings(spec=args.simulate, state_dir=Path(args.sim_state_dir)),
        metrics=metrics,
        cgroups=CgroupSettings(
            root=Path(args.cgroup_root),
            kubelet_config=Path(args.kubelet_config),
            host_root=Path(args.host_root),
            device_guard=GuardMode(args.device_guard),
            own_pod_uid=args.own_pod_uid or os.environ.get("POD_UID", ""),
            guard_exempt_namespaces=frozenset(
                n.strip() for n in args.guard_exempt_namespaces.split(",") if n.strip()
            ),
        ),
        bpf=BpfSettings(ioctl_tracing=not args.no_ioctl_tracing, bpf_dir=Path(args.bpf_dir)),
        kube=KubeSettings(
            kubeconfig=Path(args.kubeconfig) if args.kubeconfig else None,
            pod_resources_socket=Path(args.pod_resources_socket),
        ),
        enforcement=enforcement,
        sharing=sharing,
        dra=dra,
    )


def metrics_from_args(args: argparse.Namespace, host: str, port: int, problems: list[str]) -> MetricsSettings:
    auth = MetricsAuth(args.metrics_auth)
    cert, key = args.metrics_tls_cert, args.metrics_tls_key
    if bool(cert) != bool(key):
        problems.append("--metrics-tls-cert and --metrics-tls-key go together")
    if auth is MetricsAuth.KUBERNETES and args.no_kube and not args.no_metrics:
        problems.append("--metrics-auth kubernetes asks the Kubernetes API: it cannot go with --no-kube")
    return MetricsSettings(
        host=host,
        port=port,
        enabled=not args.no_metrics,
        legacy=args.legacy_metrics,
        auth=auth,
        tls_cert=Path(cert) if cert else None,
        tls_key=Path(key) if key else None,
    )


def dra_from_args(args: argparse.Namespace, problems: list[str]) -> DraSettings:
    gpus: frozenset[int] | None = None
    if args.dra_gpus.strip() != "all":
        try:
            gpus = parse_int_set(args.dra_gpus, "--dra-gpus")
        except ConfigError as err:
            problems += err.problems
    return DraSettings(
        enabled=args.dra,
        gpus=gpus,
        registry_dir=Path(args.dra_registry_dir),
        plugin_dir=Path(args.dra_plugin_dir),
        cdi_dir=Path(args.cdi_dir),
        state_dir=Path(args.state_dir),  # the prepared-claims checkpoint beside the freeze journal
    )


def enforcement_from_args(args: argparse.Namespace, problems: list[str]) -> EnforcementSettings:
    for flag, value, low, high in (
        ("--control-period", args.control_period, 0.02, 10.0),
        ("--control-window", args.control_window, 0.1, 60.0),
        ("--control-gain", args.control_gain, 0.05, 1.0),
        ("--control-max-cycle", args.control_max_cycle, 0.1, 10.0),
        ("--control-idle-hold", args.control_idle_hold, 0.0, 300.0),
        ("--control-cycle", args.control_cycle, 0.05, 10.0),
        ("--control-max-wait", args.control_max_wait, 0.5, 60.0),
        ("--memory-check", args.memory_check, 0.01, 5.0),
        ("--memory-check-near", args.memory_check_near, 0.0, 5.0),
    ):
        if not low <= value <= high:
            problems.append(f"{flag} {value}: must be between {low} and {high}")
    if args.control_window < args.control_period:
        problems.append(
            f"--control-window {args.control_window} is shorter than --control-period {args.control_period}"
        )
    return EnforcementSettings(
        enabled=not args.no_enforcement,
        period_s=args.control_period,
        feedback=Feedback(args.control_feedback),
        cycle_s=args.control_cycle,
        max_wait_s=args.control_max_wait,
        window_s=args.control_window,
        gain=args.control_gain,
        max_cycle_s=args.control_max_cycle,
        idle_hold_s=args.control_idle_hold,
        actuator=ActuatorMode(args.actuator),
        memory_mode=MemoryQuotaMode(args.memory_quota_mode),
        memory_check_s=args.memory_check,
        memory_check_near_s=args.memory_check_near,
        state_dir=Path(args.state_dir),
        watchdog=not args.no_watchdog,
    )


def sharing_from_args(args: argparse.Namespace, problems: list[str]) -> SharingSettings:
    control: tuple[str, ...] = ()
    if args.mps_control:
        try:
            control = tuple(shlex.split(args.mps_control))
        except ValueError as err:
            problems.append(f"--mps-control {args.mps_control!r}: {err}")
    root = Path(args.mps_root)
    if not root.is_absolute():
        problems.append(f"--mps-root {args.mps_root!r}: must be an absolute path (a host path)")
    return SharingSettings(
        mode=SharingMode(args.sharing_mode),
        mps_control=control,
        mps_root=root,
        advisory_limits=args.mps_advisory_limits,
    )


def dump_bpf(settings: Settings) -> int:
    """--dump-bpf: the exact programs the agent would load."""
    try:
        tracer = IoctlTracer(source_path=settings.bpf.bpf_dir / "ioctl_tracer.c").source()
        guard = dump_source(settings.bpf.bpf_dir / "device_guard.c")
    except VcudaError as err:
        log.error("cannot generate the BPF programs: %s", err)
        return EXIT_FAILED
    print(f"// ==== ioctl tracer ====\n{tracer}\n// ==== device guard (cgroup v2) ====\n{guard}")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        config = load_config(settings.config_file) if settings.config_file else ClusterConfig()
    except ConfigError as err:
        for problem in err.problems:
            log.error("invalid configuration: %s", problem)
        return EXIT_CONFIG
    if args.dump_bpf:
        return dump_bpf(settings)
    signals = SignalWaiter((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    try:
        return _serve(settings, config, signals)
    finally:
        signals.close()


def _serve(settings: Settings, config: ClusterConfig, signals: SignalWaiter) -> int:
    try:
        agent = NodeAgent(settings, config)
    except VcudaError as err:
        log.error("cannot start: %s", err)
        return EXIT_FAILED
    try:
        agent.start()
        frozen = freeze_startup_heap()
        log.info("running; send SIGTERM or SIGINT to stop, SIGHUP to re-read the config")
        log.debug("start-up heap frozen: %d objects left out of full garbage collections", frozen)
        stopping = False
        while not stopping:
            for signum in signals.wait():  # asleep until one comes: no wakeups in between
                log.info("received %s", signum.name)
                if signum is signal.SIGHUP:
                    agent.config.reload()
                else:
                    stopping = True
    except (VcudaError, OSError) as err:
        log.error("cannot start: %s", err)
        return EXIT_FAILED
    finally:
        agent.stop()
    return 0
