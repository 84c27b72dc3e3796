"""Which GPUs a memory check reads (agent.surfaces.memorynode.gpus_to_read): the ones the
checked containers use every check; the others, where nobody's quota is checked, only for
their used-memory figure once an idle_read_s."""

from __future__ import annotations

from dataclasses import replace

from agent.surfaces.memorynode import gpus_to_read
from tests.unit.enforcer_plant import spec
from tests.unit.kubefixtures import make_gpus

GPUS = make_gpus(4)


def indexes(chosen: tuple[object, ...]) -> list[int]:
    return [g.index for g in chosen]  # type: ignore[attr-defined]


def test_an_idle_node_reads_its_gpus_only_when_their_figure_is_due() -> None:
    assert gpus_to_read(GPUS, [], idle_due=False) == ()
    assert indexes(gpus_to_read(GPUS, [], idle_due=True)) == [0, 1, 2, 3]


def test_the_gpus_of_checked_containers_are_read_every_check_the_rest_when_due() -> None:
    specs = [replace(spec("a", 30), gpus=(1,)), replace(spec("b", 20), gpus=(3,)), spec("c", 10)]
    assert indexes(gpus_to_read(GPUS, specs, idle_due=False)) == [0, 1, 3]
    assert indexes(gpus_to_read(GPUS, specs, idle_due=True)) == [0, 1, 2, 3]


def test_a_container_whose_gpus_are_not_known_has_every_gpu_read() -> None:
    specs = [replace(spec("a", 30), gpus=(1,)), replace(spec("b", 20), gpus=())]
    assert indexes(gpus_to_read(GPUS, specs, idle_due=False)) == [0, 1, 2, 3]
