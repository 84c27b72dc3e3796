"""Commands of a simulated GPU node: its GPU server, its workloads, its health events, its
MPS control daemons."""

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
from agent.platform.gpu.inventory import CALL_PROCESS_SAMPLES, PER_GPU_CALLS, EventKind
from agent.platform.gpu.mpspartition import sm_count_for, throughput_curve_for
from agent.platform.gpu.sim.client import NodeClient
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.inventory import sim_gpus
from agent.platform.gpu.sim.mpsdaemon import DEFAULT_PIPE_DIR, protocol_of, send_commands, serve_mps, v3_help
from agent.platform.gpu.sim.nodefile import SimGpuSlot, SimNode, SimNodeDir
from agent.platform.gpu.sim.programs import PATTERNS, PatternSpec
from agent.platform.gpu.sim.server import GpuServer
from agent.platform.gpu.sim.spec import parse_simulate_spec
from agent.platform.gpu.sim.workload import WorkloadSpec, report, run_workload, write_report
from agent.settings import DEFAULT_SIM_STATE_DIR
from agent.surfaces.cli.common import common_options, configure_logging

log = logging.getLogger(__name__)


def gpu_main(args: argparse.Namespace) -> int:
    """Serve a node's simulated GPUs on <sim-state-dir>/gpu.sock: each GPU executes the
    work its contexts queue (time-sliced, or MPS), reports NVML-style samples late and takes
    injected health events. `vcuda-agent run --simulate` starts one when none serves its
    --sim-state-dir; start one yourself so that it outlives agent restarts. SIGTERM or SIGINT
    stops it."""
    try:
        models = parse_simulate_spec(args.simulate)
        mps = _gpu_set(args.mps, len(models))
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
    server = GpuServer(
        SimNode(args.node_name, args.simulate, os.getpid(), slots),
        configs,
        SimNodeDir(Path(args.sim_state_dir)),
        memory_limits=args.driver_memory_limits,
        mps_v3=args.driver_mps_v3,
    )
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
    """Run a CUDA-like workload on a simulated GPU: a real process that submits kernels to
    its GPU through its own context and obeys CUDA's blocking rules (a launch waits while
    the queue is full, a sync until it is empty), in one of the patterns below, holding
    --memory-mib of GPU memory, until --duration ends or SIGTERM/SIGINT. Its MPS share is read
    from CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, as a CUDA client does."""
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
    """A stand-in for nvidia-cuda-mps-control on a simulated node. With -f: the control
    daemon, serving the GPU named by CUDA_VISIBLE_DEVICES (its UUID) as its MPS server, with
    the pipe and log directories of CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, until
    quit or SIGTERM/SIGINT. Without: the command client, sending the commands on stdin
    (set_default_active_thread_percentage 30, get_server_list, quit...) to the daemon of
    CUDA_MPS_PIPE_DIRECTORY and printing what each answers."""
    try:
        protocol = protocol_of(args.protocol, os.environ)
    except VcudaError as err:
        log.error("%s", err)
        return 2
    if args.help:
        if protocol != 3:
            print(mps_main.__doc__)
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
    """Inject a health event into a running simulated node: an XID error (critical ones make
    the GPU Unhealthy), the GPU falling off the bus (its contexts are lost), or its recovery;
    or a fault: an NVML call of the agent on the GPU that hangs for some seconds."""
    root = SimNodeDir(Path(args.sim_state_dir))
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
                client.post_event(args.gpu, EventKind.XID.value, xid=args.xid, detail="injected")
        finally:
            client.close()
    except VcudaError as err:
        log.error("%s", err)
        return 1
    print(f"event posted for GPU {args.gpu} of simulated node {node.node_name}")
    return 0


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-gpu``, ``sim-workload`` and ``sim-event``."""
    p = sub.add_parser(
        "sim-gpu", parents=[common], help="serve a node's simulated GPUs", description=gpu_main.__doc__
    )
    p.add_argument("--simulate", required=True, metavar="SPEC", help="the GPUs, e.g. 2xH100-80GB")
    p.add_argument("--node-name", default="sim-node", help="the node's name (the GPUs' UUIDs derive from it)")
    p.add_argument("--timeslice-ms", type=float, default=2.0, help="time-slice between contexts (default 2)")
    p.add_argument(
        "--sample-period",
        type=float,
        metavar="S",
        help="NVML sample period, 0.01..1 s (default: the model's, 1/6 s)",
    )
    p.add_argument(
        "--sample-delay",
        type=float,
        default=0.25,
        metavar="S",
        help="samples arrive this late (default 0.25)",
    )
    p.add_argument(
        "--sample-jitter",
        type=float,
        default=0.25,
        metavar="S",
        help="...plus up to this much more (default 0.25)",
    )
    p.add_argument(
        "--queue-depth", type=int, default=1024, help="launches a context queues before one blocks"
    )
    p.add_argument("--mps", metavar="GPUS", help="GPUs in MPS mode: indexes like 0,1, or all (default none)")
    p.add_argument(
        "--mps-samples",
        choices=("server", "client"),
        default="server",
        help="under an MPS control daemon, NVML credits the clients' work to the MPS server (as NVIDIA "
        "documents; default) or to each client",
    )
    p.add_argument(
        "--driver-memory-limits",
        action="store_true",
        help="the driver limits GPU memory per cgroup (nvmlDeviceSetMemoryLimits_v1, R615+; "
        "default: an older driver without)",
    )
    p.add_argument(
        "--driver-mps-v3",
        action="store_true",
        help="the driver is r615+/R620: its MPS control daemon speaks protocol 3, namespaces bound to "
        "cgroups (default: an older driver without)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the samples' jitter")
    p.add_argument(
        "--exit-with-fd", type=int, help=argparse.SUPPRESS
    )  # the agent's pipe: stop when it closes
    add_sim_state_dir(p)
    p.set_defaults(func=gpu_main)

    p = sub.add_parser(
        "sim-workload",
        parents=[common],
        help="a CUDA-like workload on a simulated GPU",
        description=workload_main.__doc__,
    )
    p.add_argument("--gpu", type=int, required=True, help="simulated GPU index")
    p.add_argument(
        "--pattern",
        choices=PATTERNS,
        default="train",
        help="train: steps of kernels then a sync; infer: requests at --rate; burn: a full queue of long "
        "kernels; graph: CUDA graphs; bursty: train for --on s, idle for --off s (default train)",
    )
    p.add_argument("--memory-mib", type=int, default=0, help="GPU memory it allocates, in MiB")
    p.add_argument(
        "--busy", type=float, default=1.0, help="train/bursty: share of an idle GPU its steps keep busy"
    )
    p.add_argument(
        "--kernels", type=int, help="kernels per step, request or graph (default by pattern: 20, 4, 1, 50)"
    )
    p.add_argument(
        "--kernel-ms", type=float, help="GPU milliseconds per kernel (default 2; burn 20; graph 1)"
    )
    p.add_argument("--rate", type=float, default=30.0, help="infer: requests per second (default 30)")
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="infer: 0 open loop (default); N closed-loop clients, each waiting for its answer",
    )
    p.add_argument(
        "--sync-every", type=int, help="burn: launches per sync, 0 never (default); graph: graphs per sync"
    )
    p.add_argument("--on", type=float, default=3.0, metavar="S", help="bursty: seconds busy (default 3)")
    p.add_argument("--off", type=float, default=3.0, metavar="S", help="bursty: seconds idle (default 3)")
    p.add_argument("--seed", type=int, default=0, help="infer: seed of the arrivals")
    p.add_argument("--duration", type=float, help="seconds to run (default: until SIGTERM/SIGINT)")
    p.add_argument(
        "--grow-to-mib", type=int, metavar="N", help="after --grow-after seconds, hold N MiB instead"
    )
    p.add_argument(
        "--grow-after", type=float, default=0.0, metavar="S", help="seconds before --grow-to-mib applies"
    )
    p.add_argument(
        "--grow-step-mib",
        type=int,
        default=0,
        metavar="N",
        help="grow toward --grow-to-mib by N MiB every --grow-every seconds (default 0: at once)",
    )
    p.add_argument(
        "--grow-every", type=float, default=0.0, metavar="S", help="seconds between --grow-step-mib steps"
    )
    p.add_argument(
        "--driver-ioctls",
        action="store_true",
        help="also make NVIDIA-shaped ioctls (RM_ALLOC of its memory, RM_CONTROL per sync) for the tracer",
    )
    p.add_argument(
        "--report", metavar="FILE", help="write what it did (requests, latency p50/p99) as JSON at exit"
    )
    p.add_argument(
        "--latency-after",
        type=float,
        default=0.0,
        metavar="S",
        help="the report's latency p50/p99 over requests answered at least S seconds after the start "
        "(default 0: all)",
    )
    p.add_argument(
        "--progress",
        metavar="FILE",
        help="append the wall time of each completed step (a sync returned; burn without syncs: a batch "
        "of launches queued) to FILE, one per line",
    )
    add_sim_state_dir(p)
    p.set_defaults(func=workload_main)

    add_event_parser(sub, common)

    p = sub.add_parser(
        "sim-mps-control",
        parents=[common],
        help="a stand-in for nvidia-cuda-mps-control on a simulated node",
        description=mps_main.__doc__,
        add_help=False,  # -h is the daemon's own (with -p 3: the v3 modules, where the driver has them)
    )
    p.add_argument("-h", "--help", action="store_true", help="print the usage (-p 3 -h: the v3 modules)")
    p.add_argument("-p", "--protocol", type=int, choices=(2, 3), help="MPS protocol (3: MPS v3, r615+)")
    p.add_argument("-f", dest="foreground", action="store_true", help="run the daemon in the foreground")
    p.add_argument("-d", dest="background", action="store_true", help="background mode: not supported")
    p.add_argument(
        "words", nargs=argparse.REMAINDER, help="one command in MPS v3's module-verb form (else: stdin)"
    )
    add_sim_state_dir(p)
    p.set_defaults(func=mps_main)


def add_event_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-event``: health events, and the hang fault-injection knob."""
    p = sub.add_parser(
        "sim-event",
        parents=[common],
        help="inject a health event into a simulated GPU",
        description=event_main.__doc__,
    )
    p.add_argument("--gpu", type=int, required=True, help="simulated GPU index")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--xid", type=int, help="an XID error, e.g. 79 (fell off the bus) or 48 (double-bit ECC)"
    )
    kind.add_argument("--lost", action="store_true", help="the GPU falls off the bus")
    kind.add_argument("--recover", action="store_true", help="the GPU was reset and is healthy again")
    kind.add_argument(
        "--hang", type=float, metavar="S", help="fault injection: the agent's --call on the GPU hangs for S s"
    )
    p.add_argument(
        "--call",
        default=CALL_PROCESS_SAMPLES,
        choices=("*", *PER_GPU_CALLS),
        help=f"the NVML function that hangs, * for all (default {CALL_PROCESS_SAMPLES})",
    )
    add_sim_state_dir(p)
    p.set_defaults(func=event_main)


def add_sim_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-state-dir",
        default=str(DEFAULT_SIM_STATE_DIR),
        metavar="DIR",
        help=f"the simulated node's directory (default {DEFAULT_SIM_STATE_DIR})",
    )


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
