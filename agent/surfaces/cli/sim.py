"""Commands that act on a simulated GPU node."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from agent.errors import VcudaError
from agent.platform.gpu.inventory import EventKind
from agent.platform.gpu.simstate import SimStateDir
from agent.platform.gpu.simworkload import WorkloadSpec, run_workload

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
