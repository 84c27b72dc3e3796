"""What the allocation logic needs from Kubernetes and kubelet, as small protocols.

The real implementations are the pod cache and event recorder in
``agent.platform.kube`` and the pod-resources client in ``agent.platform.kubelet``;
the protocols keep this layer's tests free of HTTP and gRPC where they test logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from agent.platform.kube.pods import PodInfo


class PodSource(Protocol):
    def pods(self) -> list[PodInfo]: ...

    def snapshot(self) -> tuple[int, list[PodInfo]]: ...

    def version(self) -> int:
        """A number that changes whenever a pod of the source does."""
        ...

    def get(self, uid: str) -> PodInfo | None: ...

    def find(self, namespace: str, name: str) -> PodInfo | None: ...

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool: ...


class EventSink(Protocol):
    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None: ...

    def node(self, reason: str, message: str, warning: bool = True) -> None: ...


class DeviceRecord(Protocol):
    """One container's devices of one resource, as kubelet's pod-resources API reports them."""

    @property
    def namespace(self) -> str: ...

    @property
    def pod(self) -> str: ...

    @property
    def container(self) -> str: ...

    @property
    def resource(self) -> str: ...

    @property
    def device_ids(self) -> Sequence[str]: ...


class DeviceTruth(Protocol):
    """kubelet's pod-resources API: which pod holds which device IDs."""

    def list(self) -> Sequence[DeviceRecord]: ...

    def get(self, namespace: str, name: str) -> Sequence[DeviceRecord] | None: ...
