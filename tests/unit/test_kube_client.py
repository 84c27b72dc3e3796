"""The Kubernetes API boundary: configuration loading, error translation, reflector back-off."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from agent.clock import VirtualClock
from agent.errors import ConflictError, KubeError
from agent.platform.kube.client import api_client, api_error, call
from agent.platform.kube.nodes import pointer_escape
from agent.platform.kube.reflector import Reflector


def test_no_configuration_is_a_clear_error() -> None:
    with pytest.raises(KubeError, match="no Kubernetes API configuration"):
        api_client(None, in_cluster=False)


def test_missing_or_bad_kubeconfig(tmp_path: Path) -> None:
    with pytest.raises(KubeError, match=r"kubeconfig .*missing"):
        api_client(tmp_path / "missing", in_cluster=False)
    bad = tmp_path / "bad"
    bad.write_text("clusters: [unclosed")
    with pytest.raises(KubeError, match="cannot load"):
        api_client(bad, in_cluster=False)


def test_in_cluster_without_a_service_account(tmp_path: Path) -> None:
    with pytest.raises(KubeError, match=f"service account in {tmp_path}"):
        api_client(None, in_cluster=True, service_account_dir=tmp_path)


def test_kubeconfig_sets_the_server(tmp_path: Path) -> None:
    config = tmp_path / "kc"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    client = api_client(config, in_cluster=False, pool_size=3)
    assert client.configuration.host == "http://127.0.0.1:6443"
    assert client.configuration.connection_pool_maxsize == 3
    assert client.configuration.api_key["BearerToken"] == "Bearer abc"


def test_api_errors_carry_the_status_message() -> None:
    err = ApiException(status=409, reason="Conflict")
    err.body = '{"kind":"Status","message":"the object has been modified","code":409}'
    translated = api_error("patch pod default/p", err)
    assert isinstance(translated, ConflictError) and translated.status == 409
    assert str(translated) == "patch pod default/p failed (HTTP 409): the object has been modified"
    plain = api_error("list pods", ApiException(status=503, reason="Service Unavailable"))
    assert type(plain) is KubeError and "Service Unavailable" in str(plain)


def test_call_translates_transport_errors() -> None:
    def refused() -> None:
        raise urllib3.exceptions.MaxRetryError(None, "/api", "connection refused")  # type: ignore[arg-type]

    with pytest.raises(KubeError) as caught:
        call("read node n", refused)
    assert caught.value.status is None and isinstance(caught.value.__cause__, urllib3.exceptions.HTTPError)


def test_pointer_escape() -> None:
    assert pointer_escape("nvidia.com/vcuda-memory") == "nvidia.com~1vcuda-memory"
    assert pointer_escape("a~b/c") == "a~0b~1c"


class RecordingClock(VirtualClock):
    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        self.sleeps.append(seconds)
        return super().sleep(seconds, stop)


def test_reflector_backs_off_doubling_to_the_cap_in_virtual_time() -> None:
    clock, stop, calls = RecordingClock(), threading.Event(), []

    def failing_list(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 9:
            stop.set()
        raise ApiException(status=500, reason="boom")

    reflector = Reflector(failing_list, lambda kind, obj: None, "pods", clock=clock)
    reflector.run(stop)
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert reflector.stats.errors == 8 and not reflector.stats.synced
    assert "HTTP 500" in reflector.stats.last_error
    assert all(c["_preload_content"] is False and "watch" not in c for c in calls)
