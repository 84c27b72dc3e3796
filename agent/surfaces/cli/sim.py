"""Commands that act on a simulated GPU node."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from agent.errors import VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.simstate import SimStateDir
from agent.platform.gpu.simworkload import WorkloadSpec, run_workload
from agent.settings import DEFAULT_SIM_STATE_DIR
from agent.surfaces.cli.common import common_options, configure_logging

log = logging.getLogger(__name__)


def workload_main(args: argparse.Namespace) -> int:
    """Run a workload on a simulated GPU: pinned to the GPU's CPU core, it burns --busy
    of that core (its "SM utilization") and declares --memory-mib of GPU memory (--grow-to-mib
    after --grow-after seconds, to test memory quotas), until --duration ends or SIGTERM/SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: stop.set())
    # getattr: the growth options exist only where the parser declares them.
    grow_after = getattr(args, "grow_after", None)
    spec = WorkloadSpec(
        gpu=args.gpu,
        memory_mib=args.memory_mib,
        busy=args.busy,
        duration_s=args.duration,
        grow_to_mib=getattr(args, "grow_to_mib", None),
        grow_after_s=0.0 if grow_after is None else grow_after,
        driver_ioctls=bool(getattr(args, "driver_ioctls", False)),
    )
    try:
        run_workload(Path(args.sim_state_dir), spec, stop)
    except VcudaError as err:
        log.error("%s", err)
        return 1
    return 0


def event_main(args: argparse.Namespace) -> int:
    """Inject a health event into a running simulated node: an XID error (critical
    ones make the GPU Unhealthy), the GPU falling off the bus, or its recovery."""
    state = SimStateDir(Path(args.sim_state_dir))
    try:
        node = state.read_node()
        node.core_of(args.gpu)  # validates the index
        if args.lost:
            state.post_event(args.gpu, EventKind.LOST, detail="fell off the bus (injected)")
        elif args.recover:
            state.post_event(args.gpu, EventKind.RECOVERED, detail="reset (injected)")
        else:
            state.post_event(args.gpu, EventKind.XID, xid=args.xid, detail="injected")
    except VcudaError as err:
        log.error("%s", err)
        return 1
    print(f"event posted for GPU {args.gpu} of simulated node {node.node_name}")
    return 0


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-workload`` and ``sim-event``."""
    p = sub.add_parser(
        "sim-workload",
        parents=[common],
        help="a workload on a simulated GPU (burns its CPU core)",
        description=workload_main.__doc__,
    )
    p.add_argument("--gpu", type=int, required=True, help="simulated GPU index")
    p.add_argument("--memory-mib", type=int, default=0, help="GPU memory this workload declares, in MiB")
    p.add_argument("--busy", type=float, default=1.0, help="share of the GPU (its CPU core) to use, 0..1")
    p.add_argument("--duration", type=float, help="seconds to run (default: until SIGTERM/SIGINT)")
    p.add_argument(
        "--grow-to-mib",
        type=int,
        metavar="N",
        help="after --grow-after seconds, declare N MiB of GPU memory instead (to try memory quotas)",
    )
    p.add_argument(
        "--grow-after",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds before --grow-to-mib applies (default 0)",
    )
    p.add_argument(
        "--driver-ioctls",
        action="store_true",
        help="also issue NVIDIA-shaped ioctls (RM_ALLOC of its memory, RM_CONTROL) for the ioctl tracer",
    )
    add_sim_state_dir(p)
    p.set_defaults(func=workload_main)

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
    add_sim_state_dir(p)
    p.set_defaults(func=event_main)


def add_sim_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-state-dir",
        default=str(DEFAULT_SIM_STATE_DIR),
        metavar="DIR",
        help=f"state shared by the simulated node and its workloads (default {DEFAULT_SIM_STATE_DIR})",
    )


def sim_main(argv: Sequence[str]) -> int:
    """``python -m agent sim-workload|sim-event ...`` without the rest of the CLI: a simulated
    workload then starts in a tenth of the time (no Kubernetes client, gRPC or metrics
    imports), which matters when a demo or a test starts many of them on a busy node."""
    parser = argparse.ArgumentParser(prog="vcuda-agent")
    add_parsers(parser.add_subparsers(dest="command", metavar="COMMAND", required=True), common_options())
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    code: int = args.func(args)
    return code
