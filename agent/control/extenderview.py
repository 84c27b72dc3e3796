"""The scheduler extender's picture of the cluster: a ClusterBook fed by Node and Pod watches.

Nodes: each Node's ``nvidia.com/vcuda-inventory`` annotation is decoded into the book
(missing or malformed: the node is known but not eligible, with the reason). Pods: every pod
with GPU containers that is bound (``spec.nodeName``) and not finished is charged on its node,
with the GPUs its ``predicate-gpu-idx-*`` annotations name when its ``predicate-node`` is that
node (a container without one counts against the node as a whole, see ClusterBook.charge). A
deleted or finished pod is uncharged. Terminating pods stay charged until they are gone: their
containers still hold the GPU. An unbound pod is charged only while our own bind holds a
reservation for it: ``predicate-*`` annotations are writable by whoever may edit the pod, so
on a Pending pod without ``spec.nodeName`` they count for nothing (docs/extender.md, "What is
trusted").

Because every charge is derived from the API objects (nodeName + annotations) and nothing
else, a restarted extender rebuilds exactly the same book from its first LIST (an annotated
pod it had not bound yet holds nothing: kube-scheduler binds it again, through a reservation).

Reservations: bind charges the pod (``reserve``) before it writes anything, under the same
lock as every filter, so two concurrent binds can never both take the last share of a GPU.
While a reservation exists, watch events of that pod do not touch its charge (an old event,
from before our PATCH, would otherwise drop it); the reservation ends when the watch shows
the pod bound with its annotations, when the pod is deleted, when the bind fails
(``release``) or, for a pod that vanished without a DELETED we saw, after ``reservation_ttl_s``.

Thread-safe: one lock around the book (which is not); handlers never block on I/O under it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api

from agent.clock import Clock, SystemClock
from agent.domain.annotations import PREDICATE_NODE, AnnotationError, wants_isolation
from agent.domain.clusterbook import Assignment, ClusterBook, GpuKey, GpuUsage, NoFitError
from agent.domain.nodeinventory import INVENTORY_ANNOTATION, InventoryFormatError, decode
from agent.domain.schedrequest import PackPolicy, PodDemand, SchedulingRequestError, placed_gpus, pod_demand
from agent.errors import PodFormatError
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, PodInfo, pod_from_json
from agent.platform.kube.reflector import Reflector, ReflectorStats

log = logging.getLogger(__name__)

NOT_MANAGED = f"not managed: no {INVENTORY_ANNOTATION} annotation (is vcuda-agent running on the node?)"
# Finished pods leave the watch (as DELETED) on the server side: fewer events to parse.
ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass
class _Reservation:
    node: str
    assignment: Assignment
    expires: float  # clock.monotonic()
    bound: bool = False  # the Binding was created; waiting for the watch to show it


class ExtenderView:
    """A ClusterBook kept in step with the API, plus bind reservations (module docstring)."""

    def __init__(
        self,
        book: ClusterBook,
        *,
        node_policy: PackPolicy = PackPolicy.BINPACK,
        gpu_policy: PackPolicy = PackPolicy.BINPACK,
        reservation_ttl_s: float = 120.0,
        clock: Clock | None = None,
    ) -> None:
        self.node_policy, self.gpu_policy = node_policy, gpu_policy
        self._book = book
        self._ttl_s = reservation_ttl_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._pods: dict[str, tuple[PodInfo, PodDemand]] = {}  # GPU pods by uid
        self._reservations: dict[str, _Reservation] = {}
        self._node_rv: dict[str, str] = {}  # resourceVersion of the Node object last applied
        self._synced: set[str] = set()

    # -- readiness ---------------------------------------------------------------------------

    def mark_synced(self, what: str) -> None:
        with self._lock:
            self._synced.add(what)

    @property
    def ready(self) -> bool:
        """Both caches have completed a LIST: before that, filter would accept too much."""
        with self._lock:
            return {"nodes", "pods"} <= self._synced

    # -- nodes -------------------------------------------------------------------------------

    def on_node_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """Reflector handler for Node objects."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        if not name:
            return
        with self._lock:
            if kind == "DELETED":
                self._node_rv.pop(name, None)
                self._book.remove_node(name)
            else:
                self._apply_node(name, obj, force=True)

    def observe_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """Node objects a filter request carries (nodeCacheCapable false): apply those newer
        than what the watch gave us, so the request's view of the node is used at once."""
        with self._lock:
            for obj in nodes:
                name = str((obj.get("metadata") or {}).get("name") or "")
                if name:
                    self._apply_node(name, obj, force=False)

    def _apply_node(self, name: str, obj: Mapping[str, Any], force: bool) -> None:
        meta = obj.get("metadata") or {}
        rv = str(meta.get("resourceVersion") or "")
        old = self._node_rv.get(name)
        if old is not None and rv == old:
            return
        if not force and old is not None and rv.isdigit() and old.isdigit() and int(rv) < int(old):
            return  # the request carries an older Node than the watch delivered
        self._node_rv[name] = rv
        annotations = meta.get("annotations")  # from a request body: any JSON, not only an object
        text = annotations.get(INVENTORY_ANNOTATION) if isinstance(annotations, dict) else None
        if text is None:
            self._book.set_node(name, None, NOT_MANAGED)
            return
        try:
            inventory = decode(str(text))
        except InventoryFormatError as err:
            self._book.set_node(name, None, f"unusable {INVENTORY_ANNOTATION} annotation: {err}")
            return
        self._book.set_node(name, inventory)

    # -- pods --------------------------------------------------------------------------------

    def on_pod_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """Reflector handler for Pod objects (see the module docstring for what is charged)."""
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if kind == "DELETED":
            with self._lock:
                self._forget(uid)
            return
        if not _asks_for_gpu(obj):  # most pods: skip the parse (requests are immutable)
            if uid in self._pods:
                with self._lock:
                    self._forget(uid)
            return
        try:
            pod = pod_from_json(obj)
        except PodFormatError as err:
            log.debug("ignoring a pod the extender cannot read: %s", err)
            return
        try:
            demand = pod_demand(pod)
        except SchedulingRequestError as err:
            # Never placed by us; if another scheduler bound it, the device plugin refuses it.
            log.debug("pod %s has an invalid GPU request (%s): not charged", pod.key, err)
            demand = None
        with self._lock:
            if demand is None:
                self._forget(uid)
                return
            self._pods[uid] = (pod, demand)
            reservation = self._reservations.get(uid)
            if reservation is not None:
                if not pod.finished and not _shows_binding(pod, reservation.node):
                    return  # an event from before our bind completed: the reservation governs
                del self._reservations[uid]
            self._apply_pod(pod, demand)

    def _forget(self, uid: str) -> None:
        self._pods.pop(uid, None)
        self._reservations.pop(uid, None)
        self._book.uncharge(uid)

    def _apply_pod(self, pod: PodInfo, demand: PodDemand) -> None:
        # Only spec.nodeName puts a pod on a node: a Binding (ours, or another scheduler's) or
        # the pod's creator set it, and kubelet admits a bound pod only within the node's
        # capacity. predicate-* annotations on an unbound pod prove nothing (a tenant may write
        # them on its own Pending pod); our own unfinished binds are held by reservations.
        node = pod.node_name
        if not node or pod.finished:
            self._book.uncharge(pod.uid)
            return
        # Annotations naming another node are left from a failed bind: GPUs not known then.
        gpus: Mapping[GpuKey, tuple[int, ...]] = (
            placed_gpus(demand, pod.annotations) if pod.annotations.get(PREDICATE_NODE) == node else {}
        )
        self._book.charge(pod.uid, node, demand, gpus)

    # -- scheduling --------------------------------------------------------------------------

    def policies(self, demand: PodDemand) -> tuple[PackPolicy, PackPolicy]:
        """(node policy, GPU policy): the pod's annotations over the extender's defaults."""
        return demand.node_policy or self.node_policy, demand.gpu_policy or self.gpu_policy

    def filter(
        self, demand: PodDemand, nodes: Sequence[str], isolated: bool = False
    ) -> tuple[list[str], dict[str, str]]:
        """``isolated``: the pod asks for hardware-isolated shares (``domain/isolatedfit.py``)."""
        with self._lock:
            self._expire()
            return self._book.filter(demand, nodes, self._clock.wall(), isolated=isolated)

    def prioritize(self, demand: PodDemand, nodes: Sequence[str], isolated: bool = False) -> dict[str, int]:
        node_policy, gpu_policy = self.policies(demand)
        with self._lock:
            self._expire()
            wall = self._clock.wall()
            return self._book.prioritize(demand, nodes, wall, node_policy, gpu_policy, isolated=isolated)

    def reserve(self, pod: PodInfo, demand: PodDemand, node: str) -> Assignment:
        """Choose GPUs on ``node`` and charge them now; NoFitError when the pod does not fit.
        A charge the pod had before (annotations left from an earlier attempt) is replaced."""
        _, gpu_policy = self.policies(demand)
        try:
            isolated = isolated_pod(pod)
        except SchedulingRequestError as err:
            raise NoFitError(str(err)) from err
        with self._lock:
            self._expire()
            self._book.uncharge(pod.uid)
            try:
                wall = self._clock.wall()
                assignment = self._book.reserve(pod.uid, node, demand, gpu_policy, wall, isolated=isolated)
            except BaseException:
                self._restore(pod.uid)
                raise
            self._reservations[pod.uid] = _Reservation(
                node, assignment, self._clock.monotonic() + self._ttl_s
            )
            return assignment

    def confirm(self, uid: str) -> None:
        """The Binding exists: keep the reservation until the watch shows it (or the TTL)."""
        with self._lock:
            reservation = self._reservations.get(uid)
            if reservation is not None:
                reservation.bound = True
                reservation.expires = self._clock.monotonic() + self._ttl_s

    def release(self, uid: str) -> None:
        """The bind failed: drop the reservation; the pod's charge is what the API says again."""
        with self._lock:
            if self._reservations.pop(uid, None) is not None:
                self._restore(uid)

    def _restore(self, uid: str) -> None:
        known = self._pods.get(uid)
        if known is None:
            self._book.uncharge(uid)
        else:
            self._apply_pod(*known)

    def _expire(self) -> None:
        if not self._reservations:
            return
        now = self._clock.monotonic()
        for uid in [u for u, r in self._reservations.items() if r.expires <= now]:
            log.info("the bind reservation of pod uid %s expired before the watch showed it", uid)
            del self._reservations[uid]
            self._restore(uid)

    # -- inspection (tests, debugging) -------------------------------------------------------

    def reservations(self) -> dict[str, str]:
        """uid → node of every open reservation."""
        with self._lock:
            return {uid: r.node for uid, r in self._reservations.items()}

    def charge_of(self, uid: str) -> Assignment | None:
        with self._lock:
            return self._book.charge_of(uid)

    def gpu_usage(self, node: str) -> list[GpuUsage]:
        with self._lock:
            return self._book.gpu_usage(node)


def _asks_for_gpu(obj: Mapping[str, Any]) -> bool:
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return False
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else ():  # any JSON: skip, not crash
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for part in ("limits", "requests"):
                named = resources.get(part)
                if isinstance(named, Mapping) and (CORE_RESOURCE in named or MEMORY_RESOURCE in named):
                    return True
    return False


def _shows_binding(pod: PodInfo, node: str) -> bool:
    """The pod is bound (to our node with our annotations, or elsewhere by someone else)."""
    if not pod.node_name:
        return False
    return pod.node_name != node or pod.annotations.get(PREDICATE_NODE) == node


class ClusterWatch:
    """List+watch of all Nodes and all active Pods, feeding an ExtenderView."""

    def __init__(
        self,
        api: ApiClient,
        view: ExtenderView,
        clock: Clock | None = None,
        *,
        min_backoff_s: float = 0.5,
        watch_timeout_s: float = 300.0,
    ) -> None:
        core = CoreV1Api(api)
        options: dict[str, Any] = {
            "clock": clock,
            "min_backoff_s": min_backoff_s,
            "watch_timeout_s": watch_timeout_s,
        }
        self.nodes = Reflector(
            core.list_node,
            view.on_node_event,
            "nodes",
            on_synced=lambda: view.mark_synced("nodes"),
            **options,
        )
        self.pods = Reflector(
            core.list_pod_for_all_namespaces,
            view.on_pod_event,
            "pods",
            field_selector=ACTIVE_PODS,
            on_synced=lambda: view.mark_synced("pods"),
            **options,
        )

    def run(self, stop: threading.Event) -> None:
        """Both watches until ``stop`` is set (nodes in a thread of its own)."""
        thread = threading.Thread(target=self.nodes.run, args=(stop,), name="extender-nodes", daemon=True)
        thread.start()
        try:
            self.pods.run(stop)
        finally:
            stop.set()
            thread.join()

    def stats(self) -> dict[str, ReflectorStats]:
        return {"nodes": self.nodes.stats, "pods": self.pods.stats}


def isolated_pod(pod: PodInfo) -> bool:
    """Whether the pod asks for hardware-isolated shares; SchedulingRequestError for a value of
    ``nvidia.com/vcuda-isolation`` other than ``mig`` (it can never be scheduled)."""
    try:
        return wants_isolation(pod.annotations)
    except AnnotationError as err:
        raise SchedulingRequestError(str(err)) from err
