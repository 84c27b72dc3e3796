"""What a pod asks the scheduler extender for: validation and messages."""

from __future__ import annotations

from typing import Any

import pytest

from agent.domain.schedrequest import (
    GPU_POLICY,
    NODE_POLICY,
    ContainerDemand,
    PackPolicy,
    PodDemand,
    SchedulingRequestError,
    placed_gpus,
    pod_demand,
)
from agent.platform.kube.pods import pod_from_json
from tests.unit.kubefixtures import container, pod_json


def demand_of(*containers: dict[str, Any], **kwargs: Any) -> PodDemand | None:
    return pod_demand(pod_from_json(pod_json("p", *containers, node="", **kwargs)))


def raw(name: str, **limits: str) -> dict[str, Any]:
    resources = {f"nvidia.com/vcuda-{k}": v for k, v in limits.items()}
    return {"name": name, "image": "cuda", "resources": {"limits": resources}}


def test_pod_without_gpu_resources_passes_through() -> None:
    plain = {"name": "web", "image": "nginx", "resources": {"limits": {"cpu": "1"}}}
    assert demand_of(plain) is None
    assert demand_of(plain, annotations={NODE_POLICY: "nonsense"}) is None  # not ours to judge


def test_share_and_whole_containers_are_read_in_order() -> None:
    demand = demand_of(
        container("a", 50, 4096),
        {"name": "sidecar", "image": "x"},
        container("b", 200),
        init=(container("setup", 10, 512),),
    )
    assert demand is not None
    assert demand.containers == (
        ContainerDemand("setup", 0, True, 10, 512),
        ContainerDemand("a", 0, False, 50, 4096),
        ContainerDemand("b", 2, False, 200, 0),
    )
    assert [c.key for c in demand.containers] == [(True, 0), (False, 0), (False, 2)]
    _, a, b = demand.containers
    assert (a.whole, a.gpu_count, b.whole, b.gpu_count) == (False, 1, True, 2)
    assert [c.name for c in demand.app] == ["a", "b"] and [c.name for c in demand.init] == ["setup"]
    assert demand.node_policy is None and demand.gpu_policy is None
    assert a.describe() == "50 vcuda-core and 4096 MiB"
    assert b.describe() == "2 whole GPUs"


def test_whole_gpu_may_name_memory_and_requests_count_like_limits() -> None:
    requests = {
        "name": "train",
        "image": "x",
        "resources": {"requests": {"nvidia.com/vcuda-core": "100", "nvidia.com/vcuda-memory": "70000"}},
    }
    demand = demand_of(requests)
    assert demand is not None
    assert demand.containers == (ContainerDemand("train", 0, False, 100, 70000),)
    assert demand.containers[0].describe() == "1 whole GPU with 70000 MiB together"


def test_explicit_zeros_ask_for_nothing() -> None:
    assert demand_of(raw("z", core="0", memory="0")) is None


def test_policies_from_annotations() -> None:
    demand = demand_of(container("a", 30, 100), annotations={NODE_POLICY: "spread", GPU_POLICY: " binpack "})
    assert demand is not None
    assert (demand.node_policy, demand.gpu_policy) == (PackPolicy.SPREAD, PackPolicy.BINPACK)


@pytest.mark.parametrize(
    ("containers", "annotations", "expected"),
    [
        pytest.param(
            [container("a", 150, 4096)],
            {},
            ["container a asks for 150 nvidia.com/vcuda-core", "multiple of 100", "e.g. 50 or 100"],
            id="150-cores",
        ),
        pytest.param(
            [container("a", None, 4096)],
            {},
            ["container a asks for 4096 MiB of nvidia.com/vcuda-memory but no nvidia.com/vcuda-core"],
            id="memory-without-cores",
        ),
        pytest.param(
            [container("a", 50)],
            {},
            ["container a asks for 50 nvidia.com/vcuda-core (a share of one GPU) without", "e.g."],
            id="share-without-memory",
        ),
        pytest.param(
            [raw("a", core="0.5", memory="100")],
            {},
            ["container a: nvidia.com/vcuda-core='0.5' is not a whole number", "percent of one GPU"],
            id="fractional-quantity",
        ),
        pytest.param(
            [raw("a", core="50", memory="lots")],
            {},
            ["nvidia.com/vcuda-memory='lots' is not a whole number", "counts MiB"],
            id="bad-memory-quantity",
        ),
        pytest.param(
            [raw("a", core="50", memory="4Gi")],
            {},
            ["4294967296 MiB", "write 4096 for 4 GiB"],
            id="memory-unit-mistake",
        ),
        pytest.param(
            [container("a", 50, 100)],
            {NODE_POLICY: "pack"},
            ["annotation nvidia.com/vcuda-node-policy='pack' is not a policy (use binpack or spread)"],
            id="unknown-node-policy",
        ),
        pytest.param(
            [container("a", 50, 100)],
            {GPU_POLICY: "BINPACK"},
            ["nvidia.com/vcuda-gpu-policy='BINPACK'"],
            id="unknown-gpu-policy",
        ),
    ],
)
def test_invalid_requests_are_refused_with_reasons(
    containers: list[dict[str, Any]], annotations: dict[str, str], expected: list[str]
) -> None:
    with pytest.raises(SchedulingRequestError) as caught:
        demand_of(*containers, annotations=annotations)
    message = str(caught.value)
    assert message.startswith("pod default/p: ")
    for part in expected:
        assert part in message


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(SchedulingRequestError) as caught:
        demand_of(
            container("a", 150, 1),
            container("b", 50),
            init=(container("i", None, 5),),
            annotations={GPU_POLICY: "x"},
        )
    message = str(caught.value)
    for part in ("container a asks for 150", "container b asks for 50", "init container i asks", "'x'"):
        assert part in message


def test_placed_gpus_come_from_predicate_annotations() -> None:
    annotations = {
        "nvidia.com/predicate-gpu-idx-0": "1",
        "nvidia.com/predicate-gpu-idx-1": "2,3",
        "nvidia.com/predicate-gpu-idx-init-0": "garbage",
        "nvidia.com/predicate-gpu-idx-5": "7",
    }
    demand = demand_of(
        container("a", 50, 100), container("b", 200), container("c", 10, 10), init=(container("i", 10, 10),)
    )
    assert demand is not None
    assert placed_gpus(demand, annotations) == {(False, 0): (1,), (False, 1): (2, 3)}
