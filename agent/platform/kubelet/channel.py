"""Unix-socket gRPC plumbing shared by the plugin, the registration client and the emulator."""

from __future__ import annotations

from pathlib import Path

import grpc

from agent.errors import KubeletError
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"


def unix_target(path: Path) -> str:
    return f"unix://{path.resolve() if not path.is_absolute() else path}"


def register_with_kubelet(kubelet_socket: Path, request: pb.RegisterRequest, timeout_s: float = 5.0) -> None:
    """Call Registration.Register on kubelet's socket; raise ``KubeletError`` with kubelet's reason."""
    with grpc.insecure_channel(unix_target(kubelet_socket)) as channel:
        try:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as err:
            code, detail = rpc_error_parts(err)
            raise KubeletError(
                f"registration with kubelet at {kubelet_socket} failed ({code.name}): {detail}"
            ) from err


def rpc_error_parts(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """Status code and details of a failed call (an RpcError from a call is also a grpc.Call)."""
    code = getattr(err, "code", None)
    details = getattr(err, "details", None)
    status = code() if callable(code) else grpc.StatusCode.UNKNOWN
    text = details() if callable(details) else str(err)
    return status, str(text or status.name)
