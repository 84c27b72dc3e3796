"""Fixtures for the Kubernetes adapter tests: the fake API server and a real ``kubernetes``
client configured through a real kubeconfig file pointing at it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes.client import ApiClient, CoreV1Api

from agent.emulators.apiserver import FakeApiServer, RequestRecord
from agent.platform.kube.client import api_client

NODE = "gpu-node-1"
_T = TypeVar("_T")


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=0.2)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def kube(apiserver: FakeApiServer, tmp_path: Path) -> Iterator[ApiClient]:
    client = api_client(apiserver.write_kubeconfig(tmp_path / "kubeconfig"), in_cluster=False)
    yield client
    client.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def core(kube: ApiClient) -> CoreV1Api:
    return CoreV1Api(kube)


def wait_until(check: Callable[[], _T | None], timeout_s: float = 10.0, what: str = "condition") -> _T:
    """Poll ``check`` until it returns something truthy and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s (last: {value!r})")
        time.sleep(0.02)


@contextmanager
def running(
    task: Callable[[threading.Event], None], name: str = "task", stop: threading.Event | None = None
) -> Iterator[threading.Event]:
    """Run ``task(stop)`` in a thread; on exit set stop and require the thread to end within 3 s.
    ``stop``: the flag to use (the agent's StopSignal), else a plain Event."""
    stop = threading.Event() if stop is None else stop
    errors: list[BaseException] = []

    def body() -> None:
        try:
            task(stop)
        except BaseException as err:  # surfaced in the test below
            errors.append(err)
            raise

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=3)
    assert not thread.is_alive(), f"{name} did not stop within 3 s of its stop event"
    assert not errors, f"{name} raised {errors[0]!r}"


def pod_manifest(
    name: str,
    node: str | None = NODE,
    cores: int | None = 50,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    limits = {} if cores is None else {"nvidia.com/vcuda-core": str(cores), "nvidia.com/vcuda-memory": "1024"}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}]
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": spec,
    }


def lists(log: list[RequestRecord], path: str = "/api/v1/pods") -> list[RequestRecord]:
    return [r for r in log if r.method == "GET" and r.path == path and not r.is_watch]


def watches(log: list[RequestRecord], path: str = "/api/v1/pods") -> list[RequestRecord]:
    return [r for r in log if r.method == "GET" and r.path == path and r.is_watch]
