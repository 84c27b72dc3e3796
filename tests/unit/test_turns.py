"""Turns on one GPU (agent.domain.turns): the deficit accounts, who goes next, how long a
turn thaws, whole units of long work, and nobody frozen past the longest wait."""

from __future__ import annotations

import pytest

from agent.domain.turns import Account, Cycle, Turn, TurnSettings, next_turn

SETTINGS = TurnSettings(cycle_s=0.5, min_thaw_s=0.01, max_wait_s=8.0, max_turn_s=2.0)


def turn_at(
    at: float,
    accounts: dict[str, Account],
    predicted: dict[str, float] | None = None,
    *,
    drains: dict[str, float] | None = None,
    rates: dict[str, float] | None = None,
    cycle: Cycle[str] | None = None,
    in_flight: dict[str, float] | None = None,
) -> Turn[str]:
    return next_turn(
        at,
        accounts,
        predicted or {},
        drains=drains or {},
        rates=rates or {},
        settings=SETTINGS,
        cycle=cycle or Cycle(at, at + 0.5),
        in_flight=in_flight,
    )


def account(share: float, balance: float, unit: float = 0.0, waiting_since: float = 0.0) -> Account:
    return Account(share=share, balance=balance, measured_to=0.0, waiting_since=waiting_since, unit=unit)


def test_an_account_earns_its_share_pays_its_work_and_holds_at_most_its_bank() -> None:
    a = account(0.3, 0.0)
    a.settle(1.0, 0.1, SETTINGS)
    assert a.balance == pytest.approx(0.2)  # earned 0.3, paid 0.1
    a.settle(1.0, 0.0, SETTINGS)  # the same time again earns nothing
    assert a.balance == pytest.approx(0.2)
    a.settle(11.0, 0.0, SETTINGS)
    assert a.balance == pytest.approx(a.bank(SETTINGS)) == pytest.approx(2 * 0.3 * 0.5)
    assert account(0.3, 0.0, unit=0.74).bank(SETTINGS) == pytest.approx(2 * 0.74 + 0.15)
    assert a.now(12.0, predicted=0.25) == pytest.approx(0.3 + 0.3 - 0.25)


def test_a_turn_thaws_for_what_the_account_buys_less_the_drain_after_it() -> None:
    turn = turn_at(0.0, {"a": account(0.3, 0.15)}, drains={"a": 0.02}, rates={"a": 1.0})
    assert (turn.key, turn.start, turn.drain) == ("a", 0.0, 0.02)
    assert turn.thaw_until == pytest.approx(0.13)
    # At half the GPU while thawed it needs twice as long for the same work.
    slow = turn_at(0.0, {"a": account(0.3, 0.15)}, drains={"a": 0.02}, rates={"a": 0.5})
    assert slow.thaw_until == pytest.approx(0.26)


def test_the_one_furthest_behind_its_share_goes_first_and_once_per_cycle() -> None:
    accounts = {"a": account(0.3, 0.15), "b": account(0.6, 0.15)}
    cycle = Cycle[str](0.0, 0.5)
    first = turn_at(0.0, accounts, cycle=cycle)
    assert first.key == "a"  # 0.15 / 0.3 of a quantum behind, against 0.15 / 0.6
    second = turn_at(first.thaw_until, accounts, {"a": 0.15}, cycle=cycle)
    assert second.key == "b"
    third = turn_at(second.thaw_until, accounts, {"a": 0.15, "b": 0.15}, cycle=cycle)
    assert third.key is None and third.next_decision == pytest.approx(0.5)  # the unheld run


def test_a_container_in_debt_sits_out_until_it_has_paid() -> None:
    turn = turn_at(0.0, {"a": account(0.3, -0.2)})
    assert turn.key is None


def test_long_units_are_let_in_whole_by_the_shortest_thaw() -> None:
    # Steps of 0.74 s, a 30 % share: a turn thaws 10 ms (a step starts), the step drains.
    turn = turn_at(0.0, {"a": account(0.3, 0.5, unit=0.75)}, drains={"a": 0.7})
    assert turn.thaw_until == pytest.approx(0.01)
    assert turn.drain == pytest.approx(0.74)
    # Half a unit in the account is the least that takes one.
    assert turn_at(0.0, {"a": account(0.3, 0.3, unit=0.75)}).key is None


def test_nobody_waits_frozen_past_the_longest_wait() -> None:
    accounts = {"a": account(0.3, -5.0, waiting_since=0.0)}
    assert turn_at(7.9, accounts).key is None
    forced = turn_at(8.0, accounts)
    assert forced.key == "a" and forced.thaw_until == pytest.approx(8.01)


def test_a_unit_still_in_flight_gets_no_new_turn() -> None:
    accounts = {"a": account(0.3, 0.3)}
    turn = turn_at(0.0, accounts, in_flight={"a": 0.2})
    assert turn.key is None and turn.next_decision == pytest.approx(0.2)
