"""Run the kube-scheduler extender: filter, prioritize and bind pods that ask for
nvidia.com/vcuda-core / nvidia.com/vcuda-memory, per GPU, from the nvidia.com/vcuda-inventory
annotations the node agents publish. One replica per cluster (the bind reservations are in
memory). Point a KubeSchedulerConfiguration's extenders entry at it (deploy/base)."""

from __future__ import annotations

import argparse
import logging
import signal
import ssl
import threading
from pathlib import Path
from types import FrameType

from agent.control.extenderbind import Binder
from agent.control.extenderview import ClusterWatch, ExtenderView
from agent.domain.clusterbook import ClusterBook
from agent.domain.schedrequest import PackPolicy
from agent.errors import ConfigError, VcudaError
from agent.platform.kube.client import api_client
from agent.platform.kube.podbinding import PodBindingClient
from agent.settings import ExtenderSettings
from agent.surfaces.extender.server import ExtenderServer, ServerLimits
from agent.surfaces.extender.service import ExtenderService
from agent.surfaces.extender.transport import server_context

log = logging.getLogger(__name__)
DEFAULTS = ExtenderSettings()
_POLICIES = [p.value for p in PackPolicy]


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """Register ``vcuda-agent extender`` on the subcommands ``sub``."""
    p = sub.add_parser(
        "extender",
        parents=[common],
        help="run the kube-scheduler extender (per-GPU fit)",
        description=__doc__,
    )
    p.add_argument(
        "--listen",
        type=_address,
        default=(DEFAULTS.host, DEFAULTS.port),
        metavar="HOST:PORT",
        help=f"where the extender listens (default {DEFAULTS.host}:{DEFAULTS.port})",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="a kubeconfig file (default: the pod's service account, in-cluster)",
    )
    p.add_argument(
        "--node-policy",
        choices=_POLICIES,
        default=DEFAULTS.node_policy,
        help=f"which fitting node scores highest: binpack (the fullest) or spread (the emptiest); "
        f"pods override it with nvidia.com/vcuda-node-policy (default {DEFAULTS.node_policy})",
    )
    p.add_argument(
        "--gpu-policy",
        choices=_POLICIES,
        default=DEFAULTS.gpu_policy,
        help=f"which GPU of the node a share goes to: binpack or spread; pods override it with "
        f"nvidia.com/vcuda-gpu-policy (default {DEFAULTS.gpu_policy})",
    )
    p.add_argument(
        "--max-per-gpu",
        type=int,
        default=DEFAULTS.max_per_gpu,
        metavar="N",
        help=f"containers sharing one GPU at most (default {DEFAULTS.max_per_gpu})",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULTS.stale_after_s,
        metavar="S",
        help="a node whose inventory heartbeat is older (seconds) is not eligible "
        f"(default {DEFAULTS.stale_after_s:g})",
    )
    p.add_argument("--tls-cert", metavar="PATH", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="PATH", help="the certificate's private key (PEM)")
    p.add_argument(
        "--client-ca",
        metavar="PATH",
        help="CA bundle (PEM) that signs kube-scheduler's client certificate; filter, prioritize "
        "and bind need one (required with --tls-cert)",
    )
    p.add_argument(
        "--allow-plain-http",
        action="store_true",
        help="serve plain HTTP on a non-loopback address (anyone who reaches it can bind pods)",
    )
    p.add_argument(
        "--scheduler-name",
        dest="scheduler_names",
        action="append",
        metavar="NAME",
        help="bind only pods whose spec.schedulerName is NAME; repeat for several "
        f"(default {', '.join(DEFAULTS.scheduler_names)})",
    )
    p.set_defaults(func=main)
    return p


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT, e.g. 0.0.0.0:{DEFAULTS.port}")
    return host.strip("[]") or "0.0.0.0", int(port)


def settings_from(args: argparse.Namespace) -> ExtenderSettings:
    host, port = args.listen
    return ExtenderSettings(
        host=host,
        port=port,
        kubeconfig=_path(args.kubeconfig),
        node_policy=args.node_policy,
        gpu_policy=args.gpu_policy,
        max_per_gpu=args.max_per_gpu,
        stale_after_s=args.stale_after,
        tls_cert=_path(args.tls_cert),
        tls_key=_path(args.tls_key),
        client_ca=_path(args.client_ca),
        allow_plain_http=args.allow_plain_http,
        scheduler_names=tuple(args.scheduler_names or DEFAULTS.scheduler_names),
    )


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def main(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if settings.max_per_gpu < 1 or settings.stale_after_s <= 0:
        log.error("--max-per-gpu must be at least 1 and --stale-after positive")
        return 2
    try:
        tls = server_context(settings)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    try:
        serve(settings, stop, tls)
    except VcudaError as err:
        log.error("%s", err)
        return 1
    return 0


def serve(settings: ExtenderSettings, stop: threading.Event, tls: ssl.SSLContext | None = None) -> None:
    """Watch the cluster and serve the extender until ``stop`` is set."""
    api = api_client(settings.kubeconfig, in_cluster=settings.kubeconfig is None)
    book = ClusterBook(max_per_gpu=settings.max_per_gpu, stale_after_s=settings.stale_after_s)
    view = ExtenderView(
        book,
        node_policy=PackPolicy(settings.node_policy),
        gpu_policy=PackPolicy(settings.gpu_policy),
        reservation_ttl_s=settings.reservation_ttl_s,
    )
    watch = ClusterWatch(api, view)
    binder = Binder(view, PodBindingClient(api), scheduler_names=settings.scheduler_names)
    limits = ServerLimits(settings.read_timeout_s, settings.idle_timeout_s, settings.max_connections)
    server = ExtenderServer(
        settings.host, settings.port, ExtenderService(view, binder), tls=tls, limits=limits
    )
    watcher = threading.Thread(target=watch.run, args=(stop,), name="extender-watch", daemon=True)
    watcher.start()
    server.start()
    try:
        stop.wait()
    finally:
        stop.set()
        server.stop()
        watcher.join(timeout=10)
        api.close()  # type: ignore[no-untyped-call]
