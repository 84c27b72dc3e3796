"""The extender's bind: reserve GPUs, annotate the pod, create the Binding.

1. Read the pod (its spec gives the demand; its resourceVersion the precondition). A pod
   bound already is refused, unless it is bound to this node by us (a retried bind: success).
   So is one that is not Pending, is being deleted, or names a scheduler this extender does
   not serve: /bind acts with the extender's rights, so it re-checks what kube-scheduler
   would have (a forged request binds nothing).
2. Reserve in the ExtenderView: GPUs are chosen and charged under the view's lock, so a
   concurrent filter or bind already sees them taken.
3. PATCH ``predicate-gpu-idx-<i>`` (``-init-<i>``), ``predicate-time`` (UnixNano),
   ``predicate-node`` and ``gpu-assigned=false`` with ``metadata.resourceVersion``: the patch
   fails (409) if the pod changed since step 1, e.g. another scheduler bound it.
4. POST the Binding. The node agent reads the annotations at Allocate.

Any failure releases the reservation; after a failed Binding the annotations are removed
again (best effort: left behind on the unbound pod they charge nothing, the view counts
predicate annotations only on a bound pod). A pod that asks for no vcuda resource is bound
as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

from agent.control.annotator import AnnotationPatcher
from agent.control.extenderview import ExtenderView
from agent.domain.annotations import GPU_ASSIGNED, PREDICATE_NODE, PREDICATE_TIME, predicate_key
from agent.domain.clusterbook import Assignment, NoFitError
from agent.domain.schedrequest import SchedulingRequestError, pod_demand
from agent.errors import KubeError, PodFormatError, VcudaError
from agent.platform.kube.pods import PodInfo

log = logging.getLogger(__name__)


class PodApi(AnnotationPatcher, Protocol):
    """The annotation writer the node agent uses, plus reading a pod and binding it."""

    def get(self, namespace: str, name: str) -> PodInfo: ...

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...


class BindError(VcudaError):
    """The pod was not bound; the message is for ExtenderBindingResult.error."""


def bind_annotations(assignment: Assignment, predicate_time_ns: int) -> dict[str, str]:
    """The annotations bind writes for ``assignment``."""
    annotations = {
        predicate_key(index, init): ",".join(str(g) for g in gpus)
        for (init, index), gpus in sorted(assignment.gpus.items())
    }
    annotations[PREDICATE_TIME] = str(predicate_time_ns)
    annotations[PREDICATE_NODE] = assignment.node
    annotations[GPU_ASSIGNED] = "false"
    return annotations


class Binder:
    """The bind flow of the module docstring."""

    def __init__(
        self,
        view: ExtenderView,
        pods: PodApi,
        *,
        scheduler_names: tuple[str, ...] = ("default-scheduler", "vcuda-scheduler"),
    ) -> None:
        self._view = view
        self._pods = pods
        self._scheduler_names = scheduler_names

    def bind(self, namespace: str, name: str, uid: str, node: str) -> Assignment | None:
        """Bind the pod; returns the GPUs chosen (None for a pod without vcuda resources).
        Raises BindError with a message for the scheduler."""
        key = f"{namespace}/{name}"
        try:
            pod = self._pods.get(namespace, name)
        except (KubeError, PodFormatError) as err:
            raise BindError(f"cannot read pod {key}: {err}") from err
        if pod.uid != uid:
            raise BindError(f"pod {key} has uid {pod.uid}, not {uid}: it was deleted and re-created")
        if pod.node_name:
            if pod.node_name == node and pod.annotations.get(PREDICATE_NODE) == node:
                log.info("pod %s is bound to node %s already (a retried bind)", key, node)
                return None
            raise BindError(f"pod {key} is bound to node {pod.node_name} already")
        self._check_schedulable(pod)
        try:
            demand = pod_demand(pod)
        except SchedulingRequestError as err:
            raise BindError(f"pod {key}: {err}") from err
        if demand is None:
            self._create_binding(pod, node)
            return None
        try:
            assignment = self._view.reserve(pod, demand, node)
        except NoFitError as err:
            raise BindError(f"pod {key} no longer fits node {node}: {err}") from err
        annotations = bind_annotations(assignment, time.time_ns())
        try:
            self._pods.patch_annotations(namespace, name, annotations, pod.resource_version)
        except (KubeError, PodFormatError) as err:
            self._view.release(uid)
            raise BindError(f"cannot annotate pod {key} with its GPUs: {err}") from err
        try:
            self._create_binding(pod, node)
        except BindError:
            self._view.release(uid)
            self._unannotate(pod, annotations)
            raise
        self._view.confirm(uid)
        log.info("bound pod %s to node %s, GPUs %s", key, node, dict(assignment.gpus))
        return assignment

    def _check_schedulable(self, pod: PodInfo) -> None:
        if pod.deleting:
            raise BindError(f"pod {pod.key} is being deleted")
        if pod.phase != "Pending":
            raise BindError(f"pod {pod.key} is {pod.phase}, not Pending")
        if pod.scheduler_name not in self._scheduler_names:
            raise BindError(
                f"pod {pod.key} is scheduled by {pod.scheduler_name!r}; this extender binds only for "
                f"{', '.join(self._scheduler_names)} (--scheduler-name)"
            )

    def _create_binding(self, pod: PodInfo, node: str) -> None:
        try:
            self._pods.bind(pod.namespace, pod.name, pod.uid, node)
        except KubeError as err:
            raise BindError(f"cannot bind pod {pod.key} to node {node}: {err}") from err

    def _unannotate(self, pod: PodInfo, annotations: Mapping[str, str]) -> None:
        try:
            self._pods.patch_annotations(pod.namespace, pod.name, dict.fromkeys(annotations))
        except (KubeError, PodFormatError) as err:
            log.warning("pod %s keeps the GPU annotations of a failed bind: %s", pod.key, err)
