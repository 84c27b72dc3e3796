"""The DRA gRPC service kubelet calls: ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and the
identical v1beta1 one (kubelet 1.32-1.33), both on one ``ClaimPreparer``.

Every claim of a request gets an entry keyed by its UID: the prepared devices, or the reason
it could not be prepared in ``error`` (kubelet retries that claim and shows the text in the
pod's events). The RPC itself fails only if the request is not usable at all.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from agent.domain.dra import ClaimRef, main_request
from agent.errors import VcudaError
from agent.platform.kubelet.pb import dra_v1_pb2 as v1
from agent.platform.kubelet.pb import dra_v1_pb2_grpc as v1_grpc
from agent.platform.kubelet.pb import dra_v1beta1_pb2 as v1beta1
from agent.platform.kubelet.pb import dra_v1beta1_pb2_grpc as v1beta1_grpc
from agent.surfaces.draplugin.preparer import ClaimPreparer

log = logging.getLogger(__name__)


def prepare_response(pbm: Any, preparer: ClaimPreparer, request: Any) -> Any:
    """``pbm.NodePrepareResourcesResponse`` for ``request``; ``pbm`` is the v1 or the v1beta1
    message module (the same messages in two proto packages)."""
    response = pbm.NodePrepareResourcesResponse()
    for claim in request.claims:
        entry = response.claims[claim.uid]
        try:
            prepared = preparer.prepare(ClaimRef(claim.namespace, claim.name, claim.uid))
        except VcudaError as err:
            log.warning("NodePrepareResources: claim %s/%s refused: %s", claim.namespace, claim.name, err)
            entry.error = str(err)
            continue
        entry.devices.extend(
            pbm.Device(
                request_names=request_names(d.requests),
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=list(d.cdi_ids),
            )
            for d in prepared.devices
        )
    return response


def request_names(requests: tuple[str, ...]) -> list[str]:
    """The main requests of ``requests``, as kubelet must see them: a container names only a
    main request (``resources.claims[].request``), and kubelet hands it the devices whose
    request names contain that name; a subrequest (``gpu/small``) would match no container.
    k8s.io/dynamic-resource-allocation's kubelet plugin helper strips them the same way."""
    return list(dict.fromkeys(main_request(r) for r in requests))


def unprepare_response(pbm: Any, preparer: ClaimPreparer, request: Any) -> Any:
    response = pbm.NodeUnprepareResourcesResponse()
    for claim in request.claims:
        entry = response.claims[claim.uid]
        try:
            preparer.unprepare(ClaimRef(claim.namespace, claim.name, claim.uid))
        except VcudaError as err:
            log.warning("NodeUnprepareResources: claim %s/%s failed: %s", claim.namespace, claim.name, err)
            entry.error = str(err)
    return response


class DraServiceV1(v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodePrepareResourcesResponse:
        response: v1.NodePrepareResourcesResponse = prepare_response(v1, self.preparer, request)
        return response

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodeUnprepareResourcesResponse:
        response: v1.NodeUnprepareResourcesResponse = unprepare_response(v1, self.preparer, request)
        return response


class DraServiceV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodePrepareResourcesResponse:
        response: v1beta1.NodePrepareResourcesResponse = prepare_response(v1beta1, self.preparer, request)
        return response

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        response: v1beta1.NodeUnprepareResourcesResponse = unprepare_response(v1beta1, self.preparer, request)
        return response


def add_dra_services(server: grpc.Server, preparer: ClaimPreparer) -> None:
    v1_grpc.add_DRAPluginServicer_to_server(DraServiceV1(preparer), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DraServiceV1beta1(preparer), server)
