"""Fixtures for the Kubernetes-mode tests: a fake API server and an emulated kubelet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.cluster import EmulatedNode
from agent.emulators.kubelet import KubeletEmulator
from tests.integration.kubecluster import NODE, Cluster


@pytest.fixture
def cluster(short_dir: Path) -> Iterator[Cluster]:
    api = FakeApiServer(bookmark_interval_s=0.5)
    api.start()
    api.create_node(NODE, labels={"nvidia-device-enable": "enable"})
    pod_resources = short_dir / "pod-resources.sock"
    kubelet = KubeletEmulator(short_dir / "dp", pod_resources_socket=pod_resources)
    kubelet.start()
    try:
        yield Cluster(
            api,
            kubelet,
            EmulatedNode(api, kubelet, NODE),
            api.write_kubeconfig(short_dir / "kc"),
            pod_resources,
        )
    finally:
        kubelet.stop()
        api.stop()
