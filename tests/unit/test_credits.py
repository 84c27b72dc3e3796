"""The per-process credits' correction of the meter's split (agent.domain.credits), exactly."""

from __future__ import annotations

import pytest

from agent.domain.credits import CreditBook, CreditSettings


def test_a_credit_sets_the_credited_containers_work_and_the_neighbour_takes_the_difference() -> None:
    book = CreditBook[str](CreditSettings(activity_prior=0.8))
    # The record split a 1 s window 0.5 / 0.5; a's credit says it ran 0.7 of it (56 / 0.8).
    out = book.correct("a", 56.0, 1.0, {"a": 0.5, "b": 0.5}, alone=False)
    assert out == {"a": pytest.approx(0.2), "b": pytest.approx(-0.2)}


def test_the_difference_is_shared_in_proportion_and_never_beyond_the_windows_busy_time() -> None:
    book = CreditBook[str](CreditSettings(activity_prior=1.0))
    out = book.correct("a", 100.0, 1.0, {"a": 0.2, "b": 0.3, "c": 0.1}, alone=False)
    assert out == {"a": pytest.approx(0.4), "b": pytest.approx(-0.3), "c": pytest.approx(-0.1)}
    out = book.correct("a", 0.0, 1.0, {"a": 0.2, "b": 0.3, "c": 0.1}, alone=False)
    assert out == {"a": pytest.approx(-0.2), "b": pytest.approx(0.15), "c": pytest.approx(0.05)}


def test_nothing_moves_without_a_neighbour_in_the_window() -> None:
    book = CreditBook[str]()
    assert book.correct("a", 10.0, 1.0, {"a": 0.9}, alone=False) == {}


def test_windows_it_had_to_itself_teach_its_activity_factor_and_correct_nothing() -> None:
    book = CreditBook[str](CreditSettings(activity_prior=0.867, activity_windows=4, activity_quantile=0.8))
    # 45 % of SM activity for 0.5 s of GPU time in the window: 0.9; the first three teach
    # nothing yet (one could hold a neighbour's unexpected drain).
    for _ in range(3):
        assert book.correct("a", 45.0, 1.0, {"a": 0.5}, alone=True) == {}
        assert book.factor("a") == pytest.approx(0.867)
    # A window with a neighbour's uncredited drain in it reads low (0.7): the high quantile
    # of the recent windows is not pulled down by it.
    assert book.correct("a", 35.0, 1.0, {"a": 0.5}, alone=True) == {}
    assert book.factor("a") == pytest.approx(0.9)
    # A neighbour given part of the window (a drain the record expected): no lesson.
    book.correct("a", 20.0, 1.0, {"a": 0.5, "b": 0.1}, alone=True)
    assert book.factor("a") == pytest.approx(0.9)
    book.forget("a")
    assert book.factor("a") == pytest.approx(0.867)


@pytest.mark.parametrize(
    ("period", "window"), [(1 / 6, 1.0), (0.25, 1.0), (0.4, 0.8), (1.0, 1.0), (2.0, 2.0)]
)
def test_a_credit_covers_whole_sample_periods(period: float, window: float) -> None:
    assert CreditBook[str]().window_s(period) == pytest.approx(window)
