"""The demo's and the simulated node's subcommands, declared without importing them.

``vcuda-agent run`` on a real node must not load the GPU simulator, the emulators or the
demo (docs/architecture.md, "What the production path loads"). So the parsers of ``demo``,
``sim-gpu``, ``sim-workload``, ``sim-event`` and ``sim-mps-control`` and their help texts
live here, importing only settings and the GPU interface; each command's implementation
(:mod:`.demo`, :mod:`.sim`) is imported when that command runs.
"""

from __future__ import annotations

import argparse

from agent.platform.gpu.inventory import CALL_PROCESS_SAMPLES, PER_GPU_CALLS
from agent.settings import DEFAULT_SIM_STATE_DIR

# The simulated workloads' patterns (agent.platform.gpu.sim.programs.PATTERNS, which a unit
# test keeps equal to this): repeated so that the parser does not import the simulator.
PATTERNS = ("train", "infer", "burn", "graph", "bursty")

DEMO_DESCRIPTION = """\
A simulated GPU node at work, in two acts.

First (skip with ``--no-intro``), the device plugin: `vcuda-agent run --simulate` as a
real process against an emulated kube-apiserver (real Kubernetes JSON over HTTP) and an
emulated kubelet (the real device plugin and pod-resources APIs) admits the example pods,
shows what it published and annotated, survives a GPU fault, a kubelet restart and its own
crash, and stops on SIGTERM.

Then, live: a 4-GPU node (GPU 3 in MIG mode with two instances) whose pods run as real
processes in real container cgroups, with a table refreshed every second showing each pod's
use against its cap, its memory, its duty cycle and the agent's actions, and each MIG
instance's pod and throughput, for ``--duration`` seconds (default: until Ctrl-C on a
terminal, 30 s otherwise). Ctrl-C at any point stops everything and leaves no process,
cgroup or frozen workload behind."""

SIM_GPU_DESCRIPTION = """\
Serve a node's simulated GPUs on <sim-state-dir>/gpu.sock: each GPU executes the
work its contexts queue (time-sliced, or MPS), reports NVML-style samples late and takes
injected health events. `vcuda-agent run --simulate` starts one when none serves its
--sim-state-dir; start one yourself so that it outlives agent restarts. SIGTERM or SIGINT
stops it."""

SIM_WORKLOAD_DESCRIPTION = """\
Run a CUDA-like workload on a simulated GPU: a real process that submits kernels to
its GPU through its own context and obeys CUDA's blocking rules (a launch waits while
the queue is full, a sync until it is empty), in one of the patterns below, holding
--memory-mib of GPU memory, until --duration ends or SIGTERM/SIGINT. Its MPS share is read
from CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, as a CUDA client does."""

# Printed as it stands by `sim-mps-control -h` (the stand-in's own usage), indentation included.
SIM_MPS_CONTROL_DESCRIPTION = """\
A stand-in for nvidia-cuda-mps-control on a simulated node. With -f: the control
    daemon, serving the GPU named by CUDA_VISIBLE_DEVICES (its UUID) as its MPS server, with
    the pipe and log directories of CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, until
    quit or SIGTERM/SIGINT. Without: the command client, sending the commands on stdin
    (set_default_active_thread_percentage 30, get_server_list, quit...) to the daemon of
    CUDA_MPS_PIPE_DIRECTORY and printing what each answers."""

SIM_EVENT_DESCRIPTION = """\
Inject a health event into a running simulated node: an XID error (critical ones make
the GPU Unhealthy), the GPU falling off the bus (its contexts are lost), or its recovery;
or a fault: an NVML call of the agent on the GPU that hangs for some seconds."""


def add_demo_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``demo``."""
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="simulated GPU nodes (shares, DRA, MIG) with an emulated kubelet admitting example pods",
        description=DEMO_DESCRIPTION,
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="keep sockets, state and the agent log here (default: a temp dir)",
    )
    p.add_argument("--simulate", default="2xH100-80GB", metavar="SPEC", help="GPUs of the first act's node")
    p.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="seconds the live table runs (default: until Ctrl-C on a terminal, 30 s otherwise)",
    )
    p.add_argument(
        "--metrics-address",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where the live act's agent serves /metrics (default: a free port on loopback)",
    )
    p.add_argument("--no-intro", action="store_true", help="skip the first act (the device plugin story)")
    p.set_defaults(func=_demo_main)


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-gpu``, ``sim-workload``, ``sim-event`` and ``sim-mps-control``."""
    add_gpu_parser(sub, common)

    p = sub.add_parser(
        "sim-workload",
        parents=[common],
        help="a CUDA-like workload on a simulated GPU",
        description=SIM_WORKLOAD_DESCRIPTION,
    )
    p.add_argument("--gpu", type=int, required=True, help="simulated GPU index")
    p.add_argument(
        "--mig",
        metavar="UUID",
        help="run on this MIG device of the GPU (MIG-...; default: CUDA_VISIBLE_DEVICES when it names one)",
    )
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
    p.set_defaults(func=_workload_main)

    add_event_parser(sub, common)

    p = sub.add_parser(
        "sim-mps-control",
        parents=[common],
        help="a stand-in for nvidia-cuda-mps-control on a simulated node",
        description=SIM_MPS_CONTROL_DESCRIPTION,
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
    p.set_defaults(func=_mps_main)


def add_gpu_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-gpu``."""
    p = sub.add_parser(
        "sim-gpu", parents=[common], help="serve a node's simulated GPUs", description=SIM_GPU_DESCRIPTION
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
        "--mig",
        action="append",
        default=[],
        metavar="GPU:PROFILES",
        help="a GPU in MIG mode from the start, with a GPU instance (and its whole compute instance) "
        "per profile, created in order: 0:1g.10gb,1g.10gb,3g.40gb; 0: for none (repeat per GPU; "
        "A100-40GB/80GB, H100-80GB, H200-141GB)",
    )
    p.add_argument(
        "--exit-with-fd", type=int, help=argparse.SUPPRESS
    )  # the agent's pipe: stop when it closes
    add_sim_state_dir(p)
    p.set_defaults(func=_gpu_main)


def add_event_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``sim-event``: health events, and the hang fault-injection knob."""
    p = sub.add_parser(
        "sim-event",
        parents=[common],
        help="inject a health event into a simulated GPU",
        description=SIM_EVENT_DESCRIPTION,
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
        "--gi", type=int, metavar="ID", help="--xid: the MIG GPU instance the XID is attributed to"
    )
    p.add_argument(
        "--call",
        default=CALL_PROCESS_SAMPLES,
        choices=("*", *PER_GPU_CALLS),
        help=f"the NVML function that hangs, * for all (default {CALL_PROCESS_SAMPLES})",
    )
    add_sim_state_dir(p)
    p.set_defaults(func=_event_main)


def add_sim_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-state-dir",
        default=str(DEFAULT_SIM_STATE_DIR),
        metavar="DIR",
        help=f"the simulated node's directory (default {DEFAULT_SIM_STATE_DIR})",
    )


# The implementations, imported when their command runs ------------------------------------


def _demo_main(args: argparse.Namespace) -> int:
    from agent.surfaces.cli.demo import main  # noqa: PLC0415  (lazy: see the module docstring)

    return main(args)


def _gpu_main(args: argparse.Namespace) -> int:
    from agent.surfaces.cli.sim import gpu_main  # noqa: PLC0415

    return gpu_main(args)


def _workload_main(args: argparse.Namespace) -> int:
    from agent.surfaces.cli.sim import workload_main  # noqa: PLC0415

    return workload_main(args)


def _mps_main(args: argparse.Namespace) -> int:
    from agent.surfaces.cli.sim import mps_main  # noqa: PLC0415

    return mps_main(args)


def _event_main(args: argparse.Namespace) -> int:
    from agent.surfaces.cli.sim import event_main  # noqa: PLC0415

    return event_main(args)
