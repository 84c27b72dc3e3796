"""DRA NodePrepareResources / NodeUnprepareResources round trips over the real unix socket,
with 1000 claims already prepared on the node. Target: p99 <= 10 ms for a new claim.

Three processes, as on a node (none shares another's GIL):

- the emulated kube-apiserver (``FakeApiServer``), holding every ResourceClaim the bench
  uses (``resource.k8s.io/v1`` JSON), each allocated by "the scheduler" to a share (10-40
  cores, 4 GiB) of one of the node's GPUs;
- the DRA kubelet plugin, assembled as ``DraKubeletPlugin`` assembles it (``PreparedClaims``
  with its checkpoint directory of one file per claim, ``ClaimPreparer``, ``DraPluginEndpoint``
  with both sockets) on 8 simulated H100s, reading claims with ``ResourceClaimClient`` over
  HTTP, with a health board and a prepared-claims subscriber as the agent has;
- this process as kubelet: ``KubeletDraEmulator`` registers the plugin through
  plugins_registry and calls the DRA v1 service over the plugin's socket.

Setup: ``--claims`` claims are prepared through the socket (in requests of 50), so their
checkpoint files and CDI specs exist. Then each round, interleaved, one call each:

- new: NodePrepareResources of a claim the plugin has not seen (GET from the API server,
  CDI spec written, checkpoint file written);
- again: NodePrepareResources of one of the known claims, at random (the idempotent path:
  answered from the record while its spec exists);
- unprepare: NodeUnprepareResources of the round's new claim (spec and checkpoint file
  removed), so the node stays at ``--claims`` known claims;
- floor: NodePrepareResources with no claims (the gRPC round trip alone, same socket, same
  server).

The plugin process times its own prepare/unprepare calls and its claim reads, reported
alongside. Last, the time a restarted agent takes to load the checkpoint is measured here.

    .venv/bin/python bench/dra.py [--claims 1000] [--rounds 1000] [--warmup 50] [--seed 7]
        [--dir /tmp]

``--dir`` places the sockets, CDI specs and checkpoint (default /tmp; the agent's are under
/run and /var/run/cdi, tmpfs on most nodes: try /dev/shm).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import random
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from agent.control.draclaims import PreparedClaims
from agent.domain.dra import DRIVER, ClaimRef, PreparedClaim
from agent.domain.health import HealthBoard
from agent.emulators.apiserver import FakeApiServer
from agent.emulators.kubelet_dra import DraPluginConnection, KubeletDraEmulator
from agent.platform.driverfiles import DriverFiles
from agent.platform.gpu.sim.inventory import sim_gpus
from agent.platform.gpu.sim.spec import parse_simulate_spec
from agent.platform.kube.client import api_client
from agent.platform.kube.resourceclaims import ResourceClaimClient
from agent.settings import DeviceListStrategy, DraSettings
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.endpoint import DraPluginEndpoint
from agent.surfaces.draplugin.preparer import ClaimPreparer, ClaimReader

NODE = "gpu-node-1"
NAMESPACE = "bench"
CORES = (10, 20, 25, 30, 40)
BATCH = 50  # claims per NodePrepareResources call while setting up
VARIANTS = ("new", "again", "unprepare", "floor")
Timings = dict[str, list[float]]


# The claims ---------------------------------------------------------------------------------
def claim_objects(count: int, gpus: int, seed: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(manifest, status) of ``count`` claims, each allocated a share of one GPU of NODE."""
    rng = random.Random(seed)
    objects = []
    for i in range(count):
        cores = rng.choice(CORES)
        manifest = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"claim-{i:05d}", "namespace": NAMESPACE},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "allocationMode": "ExactCount",
                                "count": 1,
                                "capacity": {"requests": {"cores": str(cores), "memory": "4Gi"}},
                            },
                        }
                    ]
                }
            },
        }
        result = {
            "request": "gpu",
            "driver": DRIVER,
            "pool": NODE,
            "device": f"gpu-{rng.randrange(gpus)}",
            "shareID": str(uuid.UUID(int=rng.getrandbits(128))),
            "consumedCapacity": {"cores": str(cores), "memory": "4Gi"},
        }
        selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
        status = {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [selector]},
            }
        }
        objects.append((manifest, status))
    return objects


# The API server process ---------------------------------------------------------------------
def with_status(status: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The scheduler's status write: the allocation."""
    return lambda claim: {**claim, "status": status}


def serve_api(objects: list[tuple[dict[str, Any], dict[str, Any]]], root: Path, conn: Connection) -> None:
    """Create and allocate every claim, then send (kubeconfig, [ClaimRef]) and serve until told."""
    server = FakeApiServer()
    server.start()
    refs = []
    for manifest, status in objects:
        created = server.store.create("resourceclaims", NAMESPACE, manifest)
        name = created["metadata"]["name"]
        server.store.update("resourceclaims", NAMESPACE, name, with_status(status), subresource="status")
        refs.append(ClaimRef(NAMESPACE, name, created["metadata"]["uid"]))
    conn.send((server.write_kubeconfig(root / "kubeconfig"), refs))
    conn.recv()
    server.stop()


# The plugin process -------------------------------------------------------------------------
class TimedReader:
    def __init__(self, reader: ClaimReader, samples: list[float]) -> None:
        self._reader, self._samples = reader, samples

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            return self._reader.get(namespace, name)
        finally:
            self._samples.append((time.perf_counter() - started) * 1000.0)


class TimedPreparer(ClaimPreparer):
    """The plugin's own work per claim, without gRPC: prepare of a new or a known claim,
    unprepare."""

    def __init__(self, timings: Timings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timings = timings

    def prepare(self, ref: ClaimRef) -> PreparedClaim:
        label = "again" if self.store.get(ref.uid) is not None else "new"
        started = time.perf_counter()
        try:
            return super().prepare(ref)
        finally:
            self.timings[label].append((time.perf_counter() - started) * 1000.0)

    def unprepare(self, ref: ClaimRef) -> None:
        started = time.perf_counter()
        try:
            super().unprepare(ref)
        finally:
            self.timings["unprepare"].append((time.perf_counter() - started) * 1000.0)


def plugin_settings(root: Path) -> DraSettings:
    return DraSettings(
        enabled=True,
        registry_dir=root / "reg",
        plugin_dir=root / "plugin",
        cdi_dir=root / "cdi",
        state_dir=root / "state",
    )


def serve_plugin(root: Path, kubeconfig: Path, spec: str, conn: Connection) -> None:
    """The plugin until told "stop"; "reset" clears its timings, "report" sends them."""
    gpus = sim_gpus(NODE, parse_simulate_spec(spec))
    settings = plugin_settings(root)
    timings: Timings = {"new": [], "again": [], "unprepare": [], "read": []}
    api = api_client(kubeconfig, in_cluster=False)
    store = PreparedClaims(settings.checkpoint_dir)
    changed = threading.Event()
    store.subscribe(lambda _claims: changed.set())  # what the agent's ClaimLedger hooks in (a poke)
    preparer = TimedPreparer(
        timings,
        node_name=NODE,
        gpus=gpus,
        claims=TimedReader(ResourceClaimClient(api, settings.api_timeout_s), timings["read"]),
        responses=ResponseBuilder(DeviceListStrategy.MOUNTS, DriverFiles()),
        store=store,
        cdi_dir=settings.cdi_dir,
        board=HealthBoard(g.index for g in gpus),
    )
    endpoint = DraPluginEndpoint(settings, preparer)
    endpoint.start()
    conn.send("serving")
    try:
        while (command := conn.recv()) != "stop":
            if command == "reset":
                for samples in timings.values():
                    samples.clear()
                conn.send("reset")
            elif command == "report":
                conn.send({label: list(samples) for label, samples in timings.items()})
    finally:
        endpoint.stop()
        api.close()  # type: ignore[no-untyped-call]


# kubelet's side -----------------------------------------------------------------------------
def prepare_all(plugin: DraPluginConnection, refs: Sequence[ClaimRef]) -> None:
    answers = plugin.prepare(refs)
    for ref in refs:
        answer = answers[ref.uid]
        if answer.error or not answer.devices:
            raise SystemExit(f"claim {ref.key} was not prepared: {answer.error or 'no devices'}")


def unprepare_all(plugin: DraPluginConnection, refs: Sequence[ClaimRef]) -> None:
    errors = [error for error in plugin.unprepare(refs).values() if error]
    if errors:
        raise SystemExit(f"unprepare failed: {errors[0]}")


def measure(
    plugin: DraPluginConnection,
    known: list[ClaimRef],
    fresh: list[ClaimRef],
    *,
    warmup: int,
    seed: int,
    warmed: Callable[[], None],
) -> Timings:
    """One round per fresh claim: new, again, unprepare, floor; the first ``warmup`` rounds are
    not kept, and ``warmed()`` is called after them."""
    rng = random.Random(seed + 1)
    runs: Timings = {label: [] for label in VARIANTS}
    for i, ref in enumerate(fresh):
        if i == warmup:
            warmed()
        calls: list[tuple[str, Callable[[DraPluginConnection, Sequence[ClaimRef]], None], list[ClaimRef]]] = [
            ("new", prepare_all, [ref]),
            ("again", prepare_all, [rng.choice(known)]),
            ("unprepare", unprepare_all, [ref]),
            ("floor", prepare_all, []),
        ]
        for label, call, claims in calls:
            started = time.perf_counter()
            call(plugin, claims)
            if i >= warmup:
                runs[label].append((time.perf_counter() - started) * 1000.0)
    return runs


def checkpoint_load_ms(root: Path, times: int = 3) -> tuple[int, float]:
    """What a restarted agent spends reading the checkpoint directory: (claims, median ms)."""
    samples, loaded = [], 0
    for _ in range(times):
        started = time.perf_counter()
        loaded = len(PreparedClaims(plugin_settings(root).checkpoint_dir).prepared())
        samples.append((time.perf_counter() - started) * 1000.0)
    return loaded, statistics.median(samples)


# Main ---------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--claims", type=int, default=1000, help="claims prepared before timing")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--spec", default="8xH100-80GB", help="the node's simulated GPUs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp"),
        help="where the sockets, CDI specs and checkpoint go (/dev/shm: tmpfs, as /run on a node)",
    )
    args = parser.parse_args()
    if args.claims < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--claims and --rounds must be at least 1, --warmup at least 0")
    return args


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="vc-dra-", dir=args.dir))  # socket paths: 107 bytes at most
    try:
        runs, inside = run(args, root)
        loaded, load_ms = checkpoint_load_ms(root)  # every process stopped, as for a restart
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, runs, inside, loaded, load_ms)


def run(args: argparse.Namespace, root: Path) -> tuple[Timings, Timings]:
    """(round trips measured here, the plugin's own timings) of the same rounds."""
    context = multiprocessing.get_context("fork")  # before any gRPC object exists in this process
    api_conn, api_child = context.Pipe()
    plugin_conn, plugin_child = context.Pipe()
    objects = claim_objects(
        args.claims + args.warmup + args.rounds, len(parse_simulate_spec(args.spec)), args.seed
    )
    started = time.perf_counter()
    api = context.Process(target=serve_api, args=(objects, root, api_child), daemon=True)
    api.start()
    del objects  # the child has them
    children = [(api, api_conn)]
    kubelet = KubeletDraEmulator(plugin_settings(root).registry_dir)
    try:
        if not api_conn.poll(300):
            raise SystemExit("the API server process did not start")
        kubeconfig, refs = api_conn.recv()
        plugin_process = context.Process(
            target=serve_plugin, args=(root, kubeconfig, args.spec, plugin_child), daemon=True
        )
        plugin_process.start()
        children.insert(0, (plugin_process, plugin_conn))
        if not plugin_conn.poll(120):
            raise SystemExit("the plugin process did not start")
        plugin_conn.recv()
        kubelet.start()
        plugin = kubelet.wait_for_plugin(DRIVER, timeout_s=30)
        print(
            f"API server up with {len(refs)} allocated claims and plugin registered in "
            f"{time.perf_counter() - started:.1f} s"
        )
        known, fresh = refs[: args.claims], refs[args.claims :]
        started = time.perf_counter()
        for i in range(0, len(known), BATCH):
            prepare_all(plugin, known[i : i + BATCH])
        took = time.perf_counter() - started
        print(
            f"{len(known)} claims prepared in {took:.1f} s "
            f"({took / len(known) * 1000:.2f} ms a claim, {BATCH} a call)"
        )

        def warmed() -> None:  # the plugin's own timings start with the timed rounds
            plugin_conn.send("reset")
            plugin_conn.recv()

        runs = measure(plugin, known, fresh, warmup=args.warmup, seed=args.seed, warmed=warmed)
        plugin_conn.send("report")
        inside: Timings = plugin_conn.recv()
    finally:
        kubelet.stop()
        for process, conn in children:  # the plugin first, as kubelet would see it go
            with contextlib.suppress(OSError):
                conn.send("stop")
            process.join(timeout=15)
            if process.is_alive():
                process.terminate()
    return runs, inside


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(args: argparse.Namespace, runs: Timings, inside: Timings, loaded: int, load_ms: float) -> None:
    names = {
        "new": "prepare new claim",
        "again": "prepare known claim",
        "unprepare": "unprepare",
        "floor": "gRPC floor (no claims)",
        "read": "  of which: GET claim",
    }
    print(
        f"{args.rounds} rounds after {args.warmup} warm-up, {args.claims} claims known, {args.spec}, "
        f"files under {args.dir}"
    )
    print(f"{'over the socket':<26}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'mean ms':>9}")
    for label, samples in runs.items():
        print(
            f"{names[label]:<26}{statistics.median(samples):>9.2f}{percentile(samples, 0.99):>9.2f}"
            f"{max(samples):>9.2f}{statistics.fmean(samples):>9.2f}"
        )
    print("in the plugin process (no gRPC), the same rounds:")
    for label in ("new", "read", "again", "unprepare"):
        samples = inside[label]
        print(
            f"{names[label]:<26}{statistics.median(samples):>9.2f}{percentile(samples, 0.99):>9.2f}"
            f"{max(samples):>9.2f}{statistics.fmean(samples):>9.2f}"
        )
    print(f"checkpoint load (a restarted agent): {loaded} claims in {load_ms:.1f} ms")
    print(
        f"RESULT prepare_p99_ms={percentile(runs['new'], 0.99):.2f} "
        f"prepare_p50_ms={statistics.median(runs['new']):.2f} "
        f"reprepare_p99_ms={percentile(runs['again'], 0.99):.2f} "
        f"unprepare_p99_ms={percentile(runs['unprepare'], 0.99):.2f} "
        f"floor_p99_ms={percentile(runs['floor'], 0.99):.2f} "
        f"checkpoint_load_ms={load_ms:.1f}"
    )


if __name__ == "__main__":
    main()
