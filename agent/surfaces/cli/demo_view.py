"""What the demo shows of the emulated cluster: the node the agent published, the pods
it annotated, the Events it emitted, and its ledger as exported in /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer

NODE = "demo-node"
MEMORY = "nvidia.com/vcuda-memory"
_LEDGER_SERIES = (
    "vcuda_gpu_cores_allocated{",
    "vcuda_gpu_memory_allocated_bytes{",
    "vcuda_container_request_cores{",
)


def section(title: str) -> None:
    """A demo section heading."""
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def ledger_lines(metrics: str) -> list[str]:
    """The ledger as /metrics exports it, in a stable order."""
    return sorted(line for line in metrics.splitlines() if line.startswith(_LEDGER_SERIES))


class ClusterView:
    def __init__(self, api: FakeApiServer, node: str) -> None:
        self.api = api
        self.node = node

    def _node(self) -> dict[str, Any]:
        return self.api.node(self.node) or {}

    def capacity(self) -> str:
        return str((self._node().get("status") or {}).get("capacity", {}).get(MEMORY, "-"))

    def node_summary(self) -> None:
        node = self._node()
        meta = node.get("metadata") or {}
        labels = {k: v for k, v in (meta.get("labels") or {}).items() if k.startswith("nvidia.com/gpu.")}
        print(f"node {self.node}: status.capacity[{MEMORY}] = {self.capacity()} MiB (sum of GPU memory)")
        print(f"  labels: {', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}")
        raw = (meta.get("annotations") or {}).get(INVENTORY_ANNOTATION)
        if raw:
            inventory = json.loads(raw)
            gpus = [
                f"GPU {g['index']} {g['memoryMiB']} MiB healthy={g['healthy']}" for g in inventory["gpus"]
            ]
            print(
                f"  {INVENTORY_ANNOTATION} (v{inventory['version']}, heartbeat {inventory['heartbeat']}): "
                + "; ".join(gpus)
            )

    def _annotations(self, name: str) -> dict[str, str]:
        pod = self.api.pod("default", name) or {}
        return dict((pod.get("metadata") or {}).get("annotations") or {})

    def pod_summary(self, names: Sequence[str], metrics: str) -> None:
        print("\nwhat the agent wrote on the pods, and its ledger:")
        # The agent annotates off the Allocate path; give its writes a moment to land.
        _wait(lambda: all(self._annotations(n).get("nvidia.com/gpu-assigned") == "true" for n in names), 5.0)
        for name in names:
            notes = self._annotations(name)
            ours = {
                k: v for k, v in notes.items() if k.startswith(("nvidia.com/predicate", "nvidia.com/gpu-"))
            }
            print(f"  pod default/{name}: {', '.join(f'{k}={v}' for k, v in sorted(ours.items()))}")
        for event in self.api.events("default"):
            print(
                f"  Event {event['type']} {event['reason']} on pod {event['involvedObject']['name']}: "
                f"{event['message']}"
            )
        for line in ledger_lines(metrics):
            if line.startswith("vcuda_container_request_cores"):
                print(f"  {line}")
        caps = [line for line in metrics.splitlines() if line.startswith("vcuda_container_cap_ratio{")]
        print("  " + "\n  ".join(caps))

    def capacity_after_fault(self, before: str) -> None:
        started = time.monotonic()
        _wait(lambda: self.capacity() != before, 10.0)
        print(
            f"node status.capacity[{MEMORY}] {before} -> {self.capacity()} MiB after "
            f"{time.monotonic() - started:.1f} s (the unhealthy GPU no longer counts)"
        )


def _wait(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
