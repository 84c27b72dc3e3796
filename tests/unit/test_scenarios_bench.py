"""bench/scenarios.py: the expected shares, the settle, freeze and idle figures on hand-made
inputs, the mixes' generation, and a tiny run end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import named_mixes  # noqa: E402
import scenarios  # noqa: E402
from scenario_buckets import Bucket, BucketSettings  # noqa: E402
from scenario_mixes import PATTERN_KINDS, POLICIES, SAMPLE_PERIODS, Trace, generate_mix  # noqa: E402
from scenario_score import (  # noqa: E402
    FIGURES,
    Claim,
    MixScore,
    Record,
    by_one_at_a_time,
    expected_shares,
    idle_while_short,
    longest_freeze,
    one_at_a_time,
    settle_s,
    target,
    water_fill,
)


def fixed(cap: int, alone: float) -> Claim:
    return Claim("fixed-share", cap, cap, alone)


def burst(request: int, alone: float, limit: int = 100) -> Claim:
    return Claim("burst-share", request, limit, alone)


def best(alone: float) -> Claim:
    return Claim("best-effort", 5, 100, alone)


def test_a_fixed_share_gets_its_cap_or_what_it_uses_alone() -> None:
    assert expected_shares([fixed(30, 20.0), fixed(40, 100.0)], 95.0) == [20.0, 40.0]


def test_a_burst_share_gets_its_request_when_contended_else_its_limit() -> None:
    assert expected_shares([burst(20, 90.0), fixed(30, 50.0)], 95.0) == [20.0, 30.0]
    # a neighbour under 5 % alone does not contend: the burst-share one may use its limit
    assert expected_shares([burst(20, 90.0), fixed(30, 3.0)], 95.0) == [90.0, 3.0]
    assert expected_shares([burst(20, 90.0, limit=60), fixed(30, 3.0)], 95.0) == [60.0, 3.0]
    assert target([burst(20, 90.0, limit=60), fixed(30, 3.0)], 0) == 60.0
    assert target([burst(20, 90.0, limit=60), fixed(30, 30.0)], 0) == 20.0
    assert target([best(50.0), fixed(30, 30.0)], 0) is None


def test_best_effort_containers_share_what_is_left_max_min() -> None:
    got = expected_shares([fixed(30, 100.0), best(10.0), best(100.0)], 90.0)
    assert got == pytest.approx([30.0, 10.0, 50.0])
    got = expected_shares([fixed(30, 100.0), best(40.0), best(100.0)], 90.0)
    assert got == pytest.approx([30.0, 30.0, 30.0])
    assert water_fill(10.0, [2.0, 100.0, 3.0]) == pytest.approx([2.0, 5.0, 3.0])


def test_the_capacity_bounds_what_best_effort_is_expected_to_get() -> None:
    assert expected_shares([fixed(30, 100.0), best(100.0)], 120.0) == pytest.approx([30.0, 70.0])
    # the others' expected more than the capacity: nothing left, never negative
    assert expected_shares([fixed(50, 100.0), burst(40, 100.0), best(100.0)], 80.0)[2] == 0.0


def series(rates: list[tuple[float, float]], step: float = 0.05) -> list[float]:
    """Cumulative GPU seconds on a grid for (seconds, percent) pieces."""
    out, total = [0.0], 0.0
    for seconds, percent in rates:
        for _ in range(round(seconds / step)):
            total += step * percent / 100
            out.append(total)
    return out


def test_the_time_one_at_a_time_adds_what_each_needs_of_the_clock_alone() -> None:
    # A loop busy 75 % of its time needs 40 / 75 of the clock for 40 % of the GPU; a GPU-bound
    # 50 needs half of it: together more than the clock has, as on the demo's GPU 1.
    claims = [burst(40, 75.0), fixed(50, 100.0)]
    assert one_at_a_time(claims, expected_shares(claims, 100.0)) == pytest.approx(40 / 75 + 0.5)
    # One that does not use the GPU alone needs none of the clock (and divides nothing by 0).
    assert one_at_a_time([fixed(30, 100.0), fixed(20, 0.0)], [30.0, 0.0]) == pytest.approx(0.3)


def _record(policy: str, error: float, needs: float) -> Record:
    """A scored pair that should get 30 % and is ``error`` pp off, in a phase needing ``needs``."""
    return Record(
        controller="c",
        mix=0,
        sample_period_s=0.5,
        name="a",
        member="a",
        kind="train",
        policy=policy,
        phase=0,
        alone=50.0,
        capacity=100.0,
        expected=30.0,
        target=30.0,
        got=30.0 + error,
        error=error,
        settle_s=0.0,
        longest_freeze_s=0.0,
        short=error < -3,
        one_at_a_time=needs,
    )


def test_pairs_are_scored_by_their_phase_time_one_at_a_time_guaranteed_and_best_effort_apart() -> None:
    score = MixScore("c", generate_mix(1, 0, seconds=20.0))
    score.records = [
        _record("fixed-share", 1.0, 0.5),
        _record("fixed-share", 5.0, 0.0),  # nobody of its phase used the GPU alone
        _record("burst-share", -1.0, 1.5),
        _record("best-effort", -9.0, 1.5),
    ]
    classes = by_one_at_a_time([score])
    rows = {(label, group): (n, got["within3"]) for label, group, n, got in classes}
    assert rows == {
        ("<= 0.9", "guaranteed"): (2, 0.5),
        ("> 1.1", "guaranteed"): (1, 1.0),
        ("> 1.1", "best-effort"): (1, 0.0),
    }
    # every pair figure per class: the fixed 5 pp over is the first class's, the burst 1 pp
    # short the last's; the best-effort's 9 pp is nobody's guarantee
    got = {(label, group): figures for label, group, _n, figures in classes}
    assert got["<= 0.9", "guaranteed"]["max_over_pp"] == 5.0
    assert got["<= 0.9", "guaranteed"]["max_short_pp"] == 0.0
    assert got["> 1.1", "guaranteed"]["max_short_pp"] == 1.0
    assert got["> 1.1", "best-effort"]["max_short_pp"] == 0.0


def test_settle_is_the_first_start_from_which_the_use_is_within_3_pp() -> None:
    trace = Trace(0.0, 0.05, {"a": series([(4, 60.0), (16, 30.0)])}, {"a": []})
    # over [s, 20]: (60 (4 - s) + 30 * 16) / (20 - s) <= 33 from s = 2.22: the next half second
    assert settle_s(trace, "a", 0.0, 20.0, 30.0) == 2.5
    assert settle_s(trace, "a", 0.0, 20.0, 60.0) == 10.0  # never: the phase less 10 s
    assert settle_s(trace, "a", 0.0, 20.0, 33.5) == 0.0


def test_the_longest_freeze_is_clipped_to_the_window() -> None:
    records = [(1.0, True), (2.0, False), (3.0, True), (6.0, False), (8.0, True)]
    assert longest_freeze(records, 2.5, 9.0) == 3.0
    assert longest_freeze(records, 4.0, 9.0) == 2.0
    assert longest_freeze(records, 7.0, 12.0) == 4.0  # still frozen at the end
    assert longest_freeze(records, 6.5, 7.5) == 0.0
    assert longest_freeze([(0.0, True), (0.5, True), (9.0, False)], 1.0, 5.0) == 4.0  # frozen throughout


def test_idle_while_short_counts_idle_gpu_time_while_a_short_container_is_frozen_with_work() -> None:
    # a runs 10 s at 50 %, then nothing for 10 s while frozen with work; b idles throughout
    ran = {"a": series([(10, 50.0), (10, 0.0)]), "b": series([(20, 0.0)])}
    waiting = {"a": [False] * 200 + [True] * 201, "b": [False] * 401}
    trace = Trace(0.0, 0.05, ran, waiting)
    # from 10 s a is frozen with work; short of 50 over the trailing 5 s once that dips under 47
    idle = idle_while_short(trace, 5.0, 20.0, {"a": 50.0, "b": 0.0})
    assert idle == pytest.approx(10.0 - 0.3, abs=0.06)  # short from 10.3 s on
    assert idle_while_short(trace, 5.0, 20.0, {"a": 0.0, "b": 0.0}) == 0.0  # nobody short


def test_mixes_are_deterministic_and_keep_the_gpu_within_100_units() -> None:
    assert generate_mix(7, 3, seconds=40) == generate_mix(7, 3, seconds=40)
    assert generate_mix(7, 3, seconds=40) != generate_mix(8, 3, seconds=40)
    for i in range(200):
        mix = generate_mix(11, i, seconds=40)
        assert 2 <= len(mix.members) <= 4
        assert mix.sample_period_s in SAMPLE_PERIODS
        assert sum(m.cores for m in mix.members if m.policy != "best-effort") <= 100
        assert sum(m.cores for m in mix.members) <= 100
        assert sum(m.start_phase == 1 or m.stop_phase is not None for m in mix.members) <= 1
        for m in mix.members:
            assert 1.0 <= m.pattern.kernel_s * 1000 <= 40.0
            assert m.kind != "burn"
            if m.policy == "burst-share" and m.limit is not None:
                assert m.cores < m.limit <= 100
    assert generate_mix(11, 5, seconds=40, sample_period=0.5).sample_period_s == 0.5
    deep = [m.kind for i in range(200) for m in generate_mix(11, i, seconds=40, deep_queues=True).members]
    assert "burn" in deep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_policy_and_pattern_appears_across_40_mixes(seed: int) -> None:
    members = [m for i in range(40) for m in generate_mix(seed, i, seconds=40).members]
    assert {m.policy for m in members} == set(POLICIES)
    assert {m.kind for m in members} == set(PATTERN_KINDS)
    assert {generate_mix(seed, i, seconds=40).change for i in range(40)} == {"start", "stop", "none"}


def result(out: str) -> dict[str, str]:
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(item.split("=", 1) for item in last.split()[1:])


def test_a_tiny_run_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert scenarios.main(["--seed", "1", "--mixes", "2", "--seconds", "20", "--controllers", "turns"]) == 0
    out = capsys.readouterr().out
    assert "| time one at a time |" in out
    got = result(out)
    assert set(got) == {*FIGURES, "mixes", "seed"}
    for value in got.values():
        float(value)
    assert got["mixes"] == "2" and got["seed"] == "1"


def test_several_controllers_run_the_same_mixes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(scenarios.CONTROLLERS, "again", scenarios.TurnsController)
    path = tmp_path / "records.json"
    argv = ["--mixes", "1", "--seconds", "20", "--controllers", "turns,again", "--table", "--json", str(path)]
    assert scenarios.main(argv) == 0
    got = result(capsys.readouterr().out)
    assert {f"turns_{k}" for k in FIGURES} | {f"again_{k}" for k in FIGURES} <= set(got)
    for key in FIGURES:  # the same controller on the same mix: the same figures
        assert got[f"turns_{key}"] == got[f"again_{key}"]
    rows = json.loads(path.read_text())
    assert {r["controller"] for r in rows} == {"turns", "again"}


def test_the_oracle_experiments_register_and_read_the_truth(capsys: pytest.CaptureFixture[str]) -> None:
    """``--load scenario_oracles``: the experiments on the engine's truth read what really ran
    (their readings are exact); the decision on the agent's own meter reads the meter."""
    argv = ["--mixes", "1", "--seconds", "20", "--load", "scenario_oracles"]
    argv += ["--controllers", "turns-oracle,buckets-oracle,buckets-meter"]
    assert scenarios.main(argv) == 0
    got = result(capsys.readouterr().out)
    assert float(got["turns-oracle_view_p95_err_pp"]) == 0.0
    assert float(got["buckets-oracle_view_p95_err_pp"]) == 0.0
    assert {f"buckets-meter_{k}" for k in FIGURES} <= set(got)


def test_a_bucket_holds_its_share_and_goes_into_debt_for_a_long_unit() -> None:
    settings = BucketSettings(bank_s=0.5, debt_s=60.0)
    bucket = Bucket(share=0.3, balance=0.15, measured_to=0.0)
    bucket.settle(10.0, 0.0, settings, unit_s=0.0)
    assert bucket.balance == pytest.approx(0.15)  # idle: it does not save up more than its bank
    bucket.settle(11.0, 2.0, settings, unit_s=0.0)  # a 2 s unit ran: in debt, it waits to repay
    assert bucket.balance == pytest.approx(0.15 + 0.3 - 2.0)
    assert bucket.now(11.0 + 1.55 / 0.3, 0.0) == pytest.approx(0.0)


def test_the_named_mixes_run_and_score_every_container(capsys: pytest.CaptureFixture[str]) -> None:
    assert named_mixes.main(["--seconds", "32"]) == 0
    out = capsys.readouterr().out
    containers = sum(len(members) for _period, members in named_mixes.CASES.values())
    assert out.count(" should ") == containers
    got = result(out)
    assert set(got) == {"worst_abs_pp", "worst_reading_pp", "longest_freeze_s"}
    assert float(got["worst_abs_pp"]) > 0  # scored against the truth (none of them is exact)
