"""agent.platform.heap: the start-up objects leave the full collections' walk."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from agent.platform.heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the suite runs with the ordinary heap


def test_what_survives_start_up_is_frozen_and_later_objects_are_not(unfrozen: None) -> None:
    kept = [[i] for i in range(1000)]  # tracked containers, alive across the freeze
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(kept)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in kept)  # out of every generation's walk
    later = [[i] for i in range(10)]
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(o) in tracked for o in later)
