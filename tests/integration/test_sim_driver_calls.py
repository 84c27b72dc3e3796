"""A simulated workload's driver calls (``sim-workload --driver-ioctls``) seen by a real agent:
its real ioctl tracer attributes the RM_ALLOCs and RM_CONTROLs to the container, and /metrics
shows them under the pod, as it would for a CUDA process on a GPU node."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.emulators.enforcednode import EnforcedNode, enforced_node, wait_for
from tests.integration.cgroup_trees import real_layout

pytestmark = pytest.mark.privileged

MIB = 1 << 20


@pytest.fixture
def node(short_dir: Path) -> Iterator[EnforcedNode]:
    real_layout()  # skips, with the reason, where there are no cgroups to make
    with enforced_node(short_dir, agent_args=("--device-guard", "off", "--no-enforcement")) as node:
        yield node


def _sample(metrics: str, family: str, pod: str, **labels: str) -> float | None:
    wanted = [f'pod="{pod}"', *(f'{k}="{v}"' for k, v in labels.items())]
    for line in metrics.splitlines():
        if line.startswith(family + "{") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_driver_calls_of_a_simulated_workload_show_up_under_its_pod(node: EnforcedNode) -> None:
    wait_for(lambda: 'vcuda_bpf_status{node="sim-node",status="ok"} 1.0' in node.metrics(), 60, "the tracer")
    node.run_pod(
        "tracer-pod",
        20,
        busy=0.2,
        workload_mib=300,
        extra=("--driver-ioctls", "--grow-to-mib", "500", "--grow-after", "1"),
    )
    quiet = node.run_pod("quiet-pod", 20, busy=0.2, workload_mib=300)
    allocated = "vcuda_container_gpu_memory_allocated_bytes_total"
    wait_for(lambda: _sample(node.metrics(), allocated, "tracer-pod") == 500 * MIB, 15, "both allocations")
    metrics = node.metrics()
    assert _sample(metrics, "vcuda_container_ioctl_calls_total", "tracer-pod", escape="RM_ALLOC") == 2
    controls = _sample(metrics, "vcuda_container_ioctl_calls_total", "tracer-pod", escape="RM_CONTROL")
    assert controls is not None and controls >= 10  # one per 50 ms cycle
    assert _sample(metrics, allocated, "quiet-pod") is None  # without the flag: no driver calls
    assert quiet.proc.poll() is None
    assert re.search(r'vcuda_container_ioctl_calls_total\{[^}]*pod="quiet-pod"', metrics) is None
