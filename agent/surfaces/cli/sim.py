"""Commands of a simulated GPU node: its GPU server, its workloads, its health events, its
MPS control daemons. Their parsers and help texts are in :mod:`.simcommands`, which imports
this module only when one of them runs."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from agent.errors import InvalidSpecError, VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.migprofiles import MigProduct
from agent.platform.gpu.migprofiles import product as mig_product
from agent.platform.gpu.mpspartition import sm_count_for, throughput_curve_for
from agent.platform.gpu.sim.client import NodeClient
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.inventory import sim_gpus
from agent.platform.gpu.sim.mpsdaemon import DEFAULT_PIPE_DIR, protocol_of, send_commands, serve_mps, v3_help
from agent.platform.gpu.sim.nodefile import SimGpuSlot, SimNode, SimNodeDir
from agent.platform.gpu.sim.programs import PatternSpec
from agent.platform.gpu.sim.server import GpuServer
from agent.platform.gpu.sim.spec import parse_simulate_spec
from agent.platform.gpu.sim.workload import (
    WorkloadSpec,
    mig_from_environment,
    report,
    run_workload,
    write_report,
)
from agent.surfaces.cli.common import common_options, configure_logging
from agent.surfaces.cli.simcommands import SIM_MPS_CONTROL_DESCRIPTION, add_parsers

log = logging.getLogger(__name__)


def gpu_main(args: argparse.Namespace) -> int:
    """``vcuda-agent sim-gpu`` (its help: :data:`.simcommands.SIM_GPU_DESCRIPTION`)."""
    try:
        models = parse_simulate_spec(args.simulate)
        mps = _gpu_set(args.mps, len(models))
        products = [mig_product(f"{m.short_name}-{m.memory_mib // 1024}GB") for m in models]
        geometry = mig_geometry(args.mig, products)
        if set(geometry) & mps:
            raise InvalidSpecError(f"GPUs {sorted(set(geometry) & mps)}: --mps and --mig on one GPU")
        configs = []
        for i, model in enumerate(models):
            config = EngineConfig(
                memory_bytes=model.memory_mib << 20,
                timeslice_s=args.timeslice_ms / 1000,
                sample_period_s=args.sample_period
                if args.sample_period is not None
                else model.sample_period_s,
                sample_delay_s=args.sample_delay,
                sample_jitter_s=args.sample_jitter,
                queue_depth=args.queue_depth,
                mps=i in mps,
                mps_samples=args.mps_samples,
                sm_count=sm_count_for(model.product_name),
                mps_curve=throughput_curve_for(model.product_name),
                seed=args.seed,
            )
            config.validate()
            configs.append(config)
    except VcudaError as err:
        log.error("%s", err)
        return 2
    gpus = sim_gpus(args.node_name, models)
    slots = tuple(
        SimGpuSlot(
            g.index,
            g.uuid,
            g.model,
            g.memory_mib,
            c.sample_period_s,
            c.mps,
            c.nvml_aggregation,
            ring=c.nvml_view == "driver",
        )
        for g, c in zip(gpus, configs, strict=True)
    )
    try:
        server = GpuServer(
            SimNode(args.node_name, args.simulate, os.getpid(), slots),
            configs,
            SimNodeDir(Path(args.sim_state_dir)),
            memory_limits=args.driver_memory_limits,
            mps_v3=args.driver_mps_v3,
            mig_products=products,
            mig_geometry=geometry,
        )
    except VcudaError as err:  # a --mig geometry that does not fit
        log.error("%s", err)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: server.stop())
    try:
        server.listen()
        if args.exit_with_fd is not None:
            server.watch_fd(args.exit_with_fd)
        log.info("simulated GPUs %s of node %s on %s", args.simulate, args.node_name, server.root.socket)
        server.serve()
    except VcudaError as err:
        log.error("%s", err)
        return 1
    return 0


def mig_geometry(items: Sequence[str], products: Sequence[MigProduct | None]) -> dict[int, list[str]]:
    """``--mig GPU:PROFILES`` items: {GPU: profile names}; the GPU must have MIG."""
    geometry: dict[int, list[str]] = {}
    for item in items:
        gpu_text, sep, profiles = item.partition(":")
        if not sep or not gpu_text.strip().isdigit():
            raise InvalidSpecError(f"--mig {item!r}: expected GPU:PROFILES, e.g. 0:1g.10gb,3g.40gb (or 0:)")
        gpu = int(gpu_text)
        if not 0 <= gpu < len(products):
            raise InvalidSpecError(f"--mig {item!r}: no GPU {gpu} (GPUs 0..{len(products) - 1})")
        if products[gpu] is None:
            raise InvalidSpecError(
                f"--mig {item!r}: GPU {gpu} has no MIG (A100-40GB/80GB, H100-80GB and H200-141GB do)"
            )
        if gpu in geometry:
            raise InvalidSpecError(f"--mig names GPU {gpu} twice")
        geometry[gpu] = [p.strip() for p in profiles.split(",") if p.strip()]
    return geometry


def _gpu_set(text: str | None, count: int) -> set[int]:
    if not text:
        return set()
    if text == "all":
        return set(range(count))
    try:
        indexes = {int(t) for t in text.split(",") if t.strip()}
    except ValueError as err:
        raise InvalidSpecError(f"--mps {text!r}: expected GPU indexes like 0,1 or 'all'") from err
    bad = sorted(i for i in indexes if not 0 <= i < count)
    if bad:
        raise InvalidSpecError(f"--mps {text!r}: no GPU {bad[0]} (GPUs 0..{count - 1})")
    return indexes


def workload_main(args: argparse.Namespace) -> int:
    """``vcuda-agent sim-workload`` (its help: :data:`.simcommands.SIM_WORKLOAD_DESCRIPTION`)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: stop.set())
    pattern = PatternSpec(
        pattern=args.pattern,
        kernels=args.kernels,
        kernel_ms=args.kernel_ms,
        busy=args.busy,
        rate=args.rate,
        clients=args.clients,
        sync_every=args.sync_every,
        on_s=args.on,
        off_s=args.off,
        seed=args.seed,
    )
    spec = WorkloadSpec(
        gpu=args.gpu,
        mig=args.mig or mig_from_environment(),
        pattern=pattern,
        memory_mib=args.memory_mib,
        duration_s=args.duration,
        grow_to_mib=args.grow_to_mib,
        grow_after_s=args.grow_after,
        grow_step_mib=args.grow_step_mib,
        grow_every_s=args.grow_every,
        driver_ioctls=args.driver_ioctls,
        progress=Path(args.progress) if args.progress else None,
        latency_after_s=args.latency_after,
    )
    try:
        stats = run_workload(Path(args.sim_state_dir), spec, stop)
        content = report(spec, stats)
        if args.report:
            write_report(Path(args.report), content)
    except VcudaError as err:
        log.error("%s", err)
        return 1
    if stats.requests:
        log.info(
            "%d requests, latency p50 %s ms, p99 %s ms",
            stats.requests,
            content["latency_p50_ms"],
            content["latency_p99_ms"],
        )
    return 0


def mps_main(args: argparse.Namespace) -> int:
    """``vcuda-agent sim-mps-control`` (its help: :data:`.simcommands.SIM_MPS_CONTROL_DESCRIPTION`)."""
    try:
        protocol = protocol_of(args.protocol, os.environ)
    except VcudaError as err:
        log.error("%s", err)
        return 2
    if args.help:
        if protocol != 3:
            print(SIM_MPS_CONTROL_DESCRIPTION)
            return 0
        try:
            text = v3_help(Path(args.sim_state_dir))
        except (VcudaError, OSError) as err:
            log.error("cannot reach the simulated GPU server: %s", err)
            return 1
        if text is None:  # as an older nvidia-cuda-mps-control answers an option it lacks
            print("sim-mps-control: protocol 3 is not supported by this driver", file=sys.stderr)
            return 2
        print(text)
        return 0
    if args.background:
        log.error("-d (background) is not supported by the stand-in: run it with -f, as the agent does")
        return 2
    if not args.foreground:
        pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR)
        # MPS v3's module-verb form takes one command as arguments; else commands on stdin
        lines = [" ".join(args.words)] if args.words else [line.strip() for line in sys.stdin if line.strip()]
        try:
            replies = send_commands(pipe, lines)
        except OSError as err:
            log.error("cannot reach the MPS control daemon at %s: %s", pipe / "control", err)
            return 1
        for reply in replies:
            if reply:
                print(reply)
        return 1 if any(r.startswith("Error") for r in replies) else 0
    try:
        return serve_mps(Path(args.sim_state_dir), os.environ, protocol)
    except (VcudaError, OSError) as err:
        log.error("cannot serve MPS: %s", err)
        return 1


def event_main(args: argparse.Namespace) -> int:
    """``vcuda-agent sim-event`` (its help: :data:`.simcommands.SIM_EVENT_DESCRIPTION`)."""
    root = SimNodeDir(Path(args.sim_state_dir))
    if args.gi is not None and args.xid is None:
        log.error("--gi names the MIG GPU instance of an --xid event")
        return 2
    try:
        node = root.read_node()
        node.gpu(args.gpu)  # validates the index
        client = NodeClient(root.socket)
        try:
            if args.lost:
                client.post_event(args.gpu, EventKind.LOST.value, detail="fell off the bus (injected)")
            elif args.recover:
                client.post_event(args.gpu, EventKind.RECOVERED.value, detail="reset (injected)")
            elif args.hang is not None:
                client.hang(args.gpu, args.call, args.hang)
            else:
                client.post_event(
                    args.gpu, EventKind.XID.value, xid=args.xid, detail="injected", gpu_instance=args.gi
                )
        finally:
            client.close()
    except VcudaError as err:
        log.error("%s", err)
        return 1
    print(f"event posted for GPU {args.gpu} of simulated node {node.node_name}")
    return 0


def sim_main(argv: Sequence[str]) -> int:
    """``python -m agent sim-gpu|sim-workload|sim-event ...`` without the rest of the CLI:
    a simulated workload then starts in a tenth of the time (no Kubernetes client, gRPC or
    metrics imports), which matters when a demo or a test starts many of them on a busy node."""
    parser = argparse.ArgumentParser(prog="vcuda-agent")
    add_parsers(parser.add_subparsers(dest="command", metavar="COMMAND", required=True), common_options())
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    code: int = args.func(args)
    return code
