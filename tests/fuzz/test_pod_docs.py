"""What a pod's author controls: its annotations (vcuda-core-limit, vcuda-policy, the packing
policies, and the extender's predicate annotations a user can also write), its resource
quantities, and the pod object itself as the API (or a scheduler request) delivers it.

Property: each reader returns a valid value or its own error (AnnotationError, a problem
message for an Event, SchedulingRequestError, AllocationError, PodFormatError) that names the
annotation or resource at fault; nothing else escapes into Allocate, the enforcer or the extender.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agent.clock import VirtualClock
from agent.control.extenderview import ExtenderView
from agent.domain.annotations import (
    CORE_LIMIT,
    POLICY,
    AnnotationError,
    Policy,
    parse_core_limit,
    parse_gpu_indexes,
    parse_policy,
    predicate_key,
    predicate_time,
    predicated_gpus,
)
from agent.domain.clusterbook import ClusterBook
from agent.domain.ids import UNITS_PER_GPU
from agent.domain.ledger import Assignment
from agent.domain.nodeconfig import POLICIES, NodeConfig
from agent.domain.requests import check_core_request
from agent.domain.schedrequest import (
    GPU_POLICY,
    MAX_MEMORY_MIB,
    NODE_POLICY,
    SchedulingRequestError,
    pod_demand,
)
from agent.domain.specs import SpecBounds, build_spec
from agent.errors import AllocationError, PodFormatError
from agent.platform.kube.pods import CORE_RESOURCE, MEMORY_RESOURCE, ContainerInfo, PodInfo, pod_from_json
from tests.fuzz.strategies import Mutation, json_values, mutations
from tests.fuzz.tally import count

# Annotation text: digits in every script, signs, spaces, huge numbers, and anything at all.
texts = st.one_of(
    st.sampled_from(
        ["0", "1", "0,1", " 2 , 0 ", "", ",", "-1", "--5", "²", "٣", "9" * 5000, "1e3", "50", "100"]
    ),
    st.from_regex(r"\A\s*-?[0-9]{1,25}(\s*,\s*[0-9]{1,3})*\s*\Z"),
    st.text(max_size=30),
)


@given(text=texts)
@example(text="²")  # str.isdigit() is true, int() raises ValueError
@example(text="9" * 5000)  # int() refuses more than 4300 digits
def test_predicate_annotations(text: str) -> None:
    count("annotations.predicate")
    try:
        gpus = parse_gpu_indexes(text)
    except AnnotationError as err:
        assert repr(text) in str(err)
    else:
        assert gpus == tuple(sorted(set(gpus))) and all(g >= 0 for g in gpus)
    found = predicated_gpus({predicate_key(0, False): text}, 0, False)
    assert found is None or all(isinstance(g, int) and g >= 0 for g in found)
    when = predicate_time({"nvidia.com/predicate-time": text})
    assert when is None or when >= 0


@given(text=texts, request=st.integers(1, 99))
@example(text="--5", request=50)  # passed the old lstrip("-").isdigit() check, int() refused it
def test_core_limit(text: str, request: int) -> None:
    count("annotations.core-limit")
    cap, problem = parse_core_limit(text, request)
    if problem:
        assert cap == request and CORE_LIMIT in problem
    else:
        assert request <= cap <= UNITS_PER_GPU


@given(text=texts | st.sampled_from([p.value for p in Policy]), default=st.sampled_from(list(Policy)))
def test_policy(text: str, default: Policy) -> None:
    count("annotations.policy")
    policy, problem = parse_policy(text, default, "pod annotation")
    assert isinstance(policy, Policy)
    assert not problem or (POLICY in problem and policy is default)


annotation_maps = st.dictionaries(
    st.sampled_from([CORE_LIMIT, POLICY, "other"]) | st.text(max_size=10), texts, max_size=4
)


@given(
    annotations=annotation_maps,
    cores=st.sampled_from([1, 30, 99, 100, 200]),
    allowed=st.lists(st.sampled_from(POLICIES), min_size=1, unique=True),
    ratio=st.floats(1, 100),
)
def test_enforcement_spec(annotations: dict[str, str], cores: int, allowed: list[str], ratio: float) -> None:
    count("specs")
    pod = PodInfo("u", "ns", "p", annotations=annotations, containers=(ContainerInfo("c", 0, False),))
    item = Assignment("u", "ns", "p", "c", False, (0,), cores, 0 if cores >= 100 else 1000)
    bounds = SpecBounds.of(NodeConfig("n", allowed_policies=tuple(allowed), max_limit_ratio=ratio))
    spec = build_spec(item, pod, Policy.FIXED_SHARE, bounds)
    if item.whole:
        assert spec.cap is None and spec.memory_quota_mib is None
        return
    assert spec.cap is not None and cores <= spec.cap <= UNITS_PER_GPU
    assert spec.policy in bounds.allowed or spec.policy is Policy.FIXED_SHARE
    for problem in spec.problems:  # each names the annotation it is about
        assert CORE_LIMIT in problem or POLICY in problem


# -- the request a pod makes (scheduler extender, agent) ---------------------------------------

VALID = {CORE_RESOURCE: "50", MEMORY_RESOURCE: "1000", NODE_POLICY: "binpack", GPU_POLICY: "spread"}
quantities = st.one_of(
    st.sampled_from(
        ["0", "1", "50", "99", "100", "150", "200", "1Gi", "4Mi", "1k", "0.5", "-1", "²", "9" * 5000]
    ),
    st.from_regex(r"\A[0-9]{1,30}(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?\Z"),
    st.text(max_size=12),
)


def demand_of(values: dict[str, str]) -> None:
    pod = PodInfo(
        "u",
        "ns",
        "p",
        annotations={k: v for k, v in values.items() if k in (NODE_POLICY, GPU_POLICY)},
        containers=(
            ContainerInfo(
                "c", 0, False, {k: v for k, v in values.items() if k in (CORE_RESOURCE, MEMORY_RESOURCE)}
            ),
        ),
    )
    demand = pod_demand(pod)
    for c in demand.containers if demand else ():
        assert c.cores > 0 and (c.cores < UNITS_PER_GPU or c.cores % UNITS_PER_GPU == 0)
        assert 0 <= c.memory_mib <= MAX_MEMORY_MIB and (c.whole or c.memory_mib > 0)


@given(key=st.sampled_from(sorted(VALID)), value=quantities)
@example(key=CORE_RESOURCE, value="9" * 5000)  # beyond int()'s digit limit
def test_pod_demand_names_the_field(key: str, value: str) -> None:
    # One value of a valid request changed: a refusal names that resource or annotation.
    count("schedrequest")
    try:
        demand_of({**VALID, key: value})
    except SchedulingRequestError as err:
        assert key in str(err), (key, str(err))


@given(values=st.dictionaries(st.sampled_from(sorted(VALID)), quantities))
def test_pod_demand(values: dict[str, str]) -> None:
    count("schedrequest")
    try:
        demand_of(values)
    except SchedulingRequestError as err:
        assert str(err).startswith("pod ns/p: ")


@given(cores=st.integers() | st.sampled_from([0, -1, 99, 100, 101, 150, 200, 2**63]))
def test_core_rule(cores: int) -> None:
    count("requests")
    try:
        check_core_request(cores)
    except AllocationError as err:
        assert f"{cores} vcuda-core" in str(err)
    else:
        assert 0 < cores < UNITS_PER_GPU or cores % UNITS_PER_GPU == 0


# -- the pod object (API watch, extender request) ----------------------------------------------

PAYLOADS = Path(__file__).parents[1] / "integration" / "extender_payloads"
PODS = [json.loads(p.read_text()) for p in sorted(PAYLOADS.glob("pod_*.json"))]
pod_objects = st.one_of(
    st.sampled_from(PODS).flatmap(mutations).map(lambda m: m.doc),
    st.dictionaries(st.sampled_from(["metadata", "spec", "status"]), json_values),
)


def read_pod(obj: Any) -> None:
    count("pod")
    try:
        pod = pod_from_json(obj)
    except PodFormatError as err:
        assert str(err)
        return
    assert isinstance(pod.uid, str) and pod.uid and isinstance(pod.name, str) and pod.name
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in pod.annotations.items())
    for c in pod.containers:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in c.resources.items())


@given(obj=pod_objects)
@example(obj={"metadata": {"name": "p", "uid": "u", "creationTimestamp": "0001-01-01T00:00:00+14:00"}})
def test_pod_object(obj: Any) -> None:
    read_pod(obj)


@pytest.mark.parametrize("kind", ["ADDED", "MODIFIED", "DELETED"])
@given(mutation=st.sampled_from(PODS).flatmap(mutations))
@example(
    mutation=Mutation({"metadata": {"uid": "u"}, "spec": {"containers": 5}}, ("spec", "containers"), False)
)
def test_extender_pod_watch(kind: str, mutation: Mutation) -> None:
    # The extender charges GPU pods from its Pod watch: a pod it cannot read is skipped.
    count("pod")
    doc = mutation.doc
    if not isinstance(doc, dict) or (doc.get("metadata") and not isinstance(doc["metadata"], dict)):
        return  # the reflector hands over objects only: it keys them by metadata.uid
    view = ExtenderView(ClusterBook(), clock=VirtualClock())
    view.on_pod_event(kind, doc)
