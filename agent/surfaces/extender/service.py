"""The extender's verbs on request bodies: filter, prioritize, bind (wire.py has the format).

Pods that ask for neither ``nvidia.com/vcuda-core`` nor ``nvidia.com/vcuda-memory`` pass
through: filter returns the candidate nodes as they came, prioritize scores every node 0,
bind creates the Binding as is. A body that does not name either resource is passed through
without even parsing the pod. An invalid GPU request puts every node into
``failedAndUnresolvableNodes`` with the reason (preempting pods would not help it); so does
an ``nvidia.com/vcuda-isolation`` annotation other than ``mig``. A pod annotated
``nvidia.com/vcuda-isolation: mig`` is filtered to the nodes where a MIG instance for each of
its containers still fits on a GPU serving isolated shares (``domain/isolatedfit.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agent.control.extenderbind import Binder, BindError
from agent.control.extenderview import ExtenderView, isolated_pod
from agent.domain.schedrequest import PodDemand, SchedulingRequestError, pod_demand
from agent.errors import PodFormatError
from agent.platform.kube.pods import pod_from_json
from agent.surfaces.extender import wire

log = logging.getLogger(__name__)


class ExtenderService:
    """Turns request bodies into answers; WireError for bodies that are not the protocol."""

    def __init__(self, view: ExtenderView, binder: Binder) -> None:
        self.view = view
        self._binder = binder

    def filter(self, body: bytes) -> dict[str, Any]:
        args = wire.parse_args(body)
        if not wire.may_want_gpu(body):
            return wire.pass_through(args)
        try:
            demand, isolated = _demand(args.pod)
        except SchedulingRequestError as err:
            return wire.unresolvable(args, str(err))
        if demand is None:
            return wire.pass_through(args)
        if args.nodes is not None:
            self.view.observe_nodes(args.nodes)
        passed, failed = self.view.filter(demand, args.node_names, isolated)
        return wire.filter_result(args, passed, failed)

    def prioritize(self, body: bytes) -> list[dict[str, Any]]:
        args = wire.parse_args(body)
        scores: Mapping[str, int] = {}
        if wire.may_want_gpu(body):
            try:
                demand, isolated = _demand(args.pod)
            except SchedulingRequestError:
                demand, isolated = None, False  # filter has rejected every node already
            if demand is not None:
                if args.nodes is not None:
                    self.view.observe_nodes(args.nodes)
                scores = self.view.prioritize(demand, args.node_names, isolated)
        return wire.priority_list(args.node_names, scores)

    def bind(self, body: bytes) -> dict[str, Any]:
        args = wire.parse_binding(body)
        try:
            self._binder.bind(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
        except BindError as err:
            log.warning("bind failed: %s", err)
            return wire.binding_result(str(err))
        return wire.binding_result()


def _demand(pod: Mapping[str, Any]) -> tuple[PodDemand | None, bool]:
    """The pod's GPU demand, and whether it asks for hardware-isolated shares."""
    try:
        info = pod_from_json(pod)
    except PodFormatError as err:
        raise SchedulingRequestError(f"the pod in the request cannot be read: {err}") from err
    demand = pod_demand(info)
    return demand, demand is not None and isolated_pod(info)
