"""A fake API server + kubelet emulator (with pod-resources) around a real agent process."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.emulators.apiserver import FakeApiServer
from agent.emulators.cluster import EmulatedNode
from agent.emulators.kubelet import KubeletEmulator

NODE = "test-node"


@dataclass
class Cluster:
    api: FakeApiServer
    kubelet: KubeletEmulator
    node: EmulatedNode
    kubeconfig: Path
    pod_resources: Path

    @property
    def kube(self) -> tuple[Path, Path]:
        return self.kubeconfig, self.pod_resources


def pod_manifest(
    name: str,
    *containers: tuple[str, int, int | None],
    init: tuple[tuple[str, int, int | None], ...] = (),
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    def spec(c: tuple[str, int, int | None]) -> dict[str, Any]:
        limits = {"nvidia.com/vcuda-core": str(c[1])}
        if c[2] is not None:
            limits["nvidia.com/vcuda-memory"] = str(c[2])
        return {"name": c[0], "image": "cuda", "resources": {"limits": limits}}

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(annotations or {})},
        "spec": {"containers": [spec(c) for c in containers], "initContainers": [spec(c) for c in init]},
    }


def wait_until(check: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"{what} not met within {timeout_s} s (last: {last!r})")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


def pod_annotations(api: FakeApiServer, name: str) -> dict[str, str]:
    pod = api.pod("default", name) or {}
    return dict((pod.get("metadata") or {}).get("annotations") or {})
