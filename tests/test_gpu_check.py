"""The predicted speedup (specstack.speedup) and the speed check that reports it (specstack.gpu_check)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specstack import SpecstackError
from specstack.speedup import LevelCost, StackCost, drafted_at, expected_emitted, triforce


def test_expected_emitted_by_hand() -> None:
    assert expected_emitted(0.0, 5) == 1.0  # every draft rejected: only the recovered token
    assert expected_emitted(1.0, 5) == 6.0  # every draft accepted, plus the bonus token
    assert expected_emitted(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_no_acceptance_gives_no_emission_gain() -> None:
    stack = StackCost(draft_cost=1.0, levels=[LevelCost(acceptance=0.0, gamma=4, verify_cost=10.0)], autoregressive_cost=10.0)
    assert stack.time_per_token() == pytest.approx(4 * 1.0 + 10.0)  # a round costs γ drafts + a verify, emits one
    assert stack.speedup == pytest.approx(10 / 14)


def test_full_acceptance_and_free_drafts_give_gamma_plus_one() -> None:
    stack = StackCost(draft_cost=1e-12, levels=[LevelCost(acceptance=1.0, gamma=6, verify_cost=12.0)], autoregressive_cost=10.0)
    assert stack.speedup == pytest.approx((6 + 1) * 10.0 / 12.0)


def test_triforce_by_hand() -> None:
    # L1 (β = 0.8, γ1 = 2, every forward 10, t0 = 1) supplying w tokens: S(1) = 1 + 10 = 11 (one draft; a round
    # asked for one token hands up one); S(w) = 12 + 0.2 S(w-1) + 0.16 S(w-2) + 0.64 S(w-3) for w >= 2, S(<=0) = 0:
    # S(2) = 12 + 0.2·11 = 14.2, S(3) = 12 + 0.2·14.2 + 0.16·11 = 16.6, S(4) = 12 + 0.2·16.6 + 0.16·14.2 + 0.64·11
    # = 24.632, S(5) = 12 + 0.2·24.632 + 0.16·16.6 + 0.64·14.2 = 28.6704, S(6) = 12 + 0.2·28.6704 + 0.16·24.632
    # + 0.64·16.6 = 32.2992; E(0.9, 6) = 1 + 0.9 + … + 0.9^6 = 5.217031; t2 = (S(6) + 30) / E = 11.941505;
    # 25 / t2 = 2.093539. (Pricing L1 per emitted token, (2 + 10) / E(0.8, 2) = 4.918033 a token, gave 2.19.)
    stack = triforce(c_ar=25.0, c2=30.0, c1=10.0, t0=1.0, alpha=0.9, beta=0.8, gamma1=2, gamma2=6)
    assert stack.levels[0].time_per_token(drafted_at(1.0)) == pytest.approx(4.918033, rel=1e-6)
    assert stack.levels[0].supply(6, drafted_at(1.0)) == pytest.approx(32.2992, rel=1e-6)
    assert stack.time_per_token() == pytest.approx(11.941505, rel=1e-6)
    assert stack.speedup == pytest.approx(2.093539, rel=1e-6)


@given(st.floats(0, 1), st.floats(0, 1), st.integers(1, 12))
def test_more_acceptance_never_predicts_less(a: float, b: float, gamma: int) -> None:
    low, high = sorted((a, b))
    assert 1 <= expected_emitted(low, gamma) <= expected_emitted(high, gamma) * (1 + 1e-12) <= (gamma + 1) * (1 + 1e-12)
    s = [triforce(c_ar=20.0, c2=25.0, c1=6.0, t0=0.5, alpha=x, beta=x, gamma1=gamma, gamma2=gamma).speedup for x in (low, high)]
    assert s[0] <= s[1] * (1 + 1e-12)


@pytest.mark.parametrize("bad", [dict(acceptance=1.5), dict(acceptance=-0.1), dict(gamma=-1), dict(gamma=True), dict(gamma=2.0),
                                 dict(verify_cost=0.0), dict(verify_cost=-1.0), dict(verify_cost=math.nan), dict(verify_cost=math.inf)])
def test_bad_level_costs_are_refused(bad: dict) -> None:
    with pytest.raises(SpecstackError, match="is not allowed"):
        LevelCost(**{**dict(acceptance=0.5, gamma=2, verify_cost=1.0), **bad})


def test_a_stack_needs_levels() -> None:
    with pytest.raises(SpecstackError, match="at least one LevelCost"):
        StackCost(draft_cost=1.0, levels=(), autoregressive_cost=1.0)


def test_gpu_check_tiny_writes_a_table_with_a_finite_prediction(tmp_path, capsys) -> None:
    from specstack.gpu_check import main

    out = tmp_path / "gpu.md"
    assert main(["--tiny", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("## GPU check, ") and "torch " in text and "transformers " in text
    rows = [line for line in text.splitlines() if re.match(r"\| (256|512) \|", line)]
    assert len(rows) == 2 and not any("does not fit" in line for line in rows)
    predicted = [float(line.split("|")[-3].strip().rstrip("×")) for line in rows]
    assert all(math.isfinite(p) and p > 0 for p in predicted)
    assert capsys.readouterr().out.strip().splitlines()[-1] == rows[-1]  # the table is printed last


def test_the_report_summarises_a_verbose_pytest_log_even_when_cut_short(tmp_path) -> None:
    from specstack.gpu_check import tests_summary

    log = tmp_path / "gpu-tests.log"
    log.write_text("[gw0] [ 10%] PASSED tests/test_cuda.py::test_a[cuda]\n[gw1] [ 20%] FAILED tests/test_greedy.py::test_b\n")
    cut = tests_summary(log)
    assert "1 passed, 1 failed, then the time cap stopped pytest" in cut and "- FAILED tests/test_greedy.py::test_b" in cut
    interrupted = log.read_text() + "!!!! KeyboardInterrupt !!!!\n==== 1 failed, 1 passed in 3.0s ====\n"
    log.write_text(interrupted)  # the cap's SIGINT: pytest still prints its summary line
    assert "1 passed, 1 failed, then the time cap stopped pytest" in tests_summary(log)
    log.write_text(log.read_text().replace("!!!! KeyboardInterrupt !!!!\n", ""))
    assert "1 passed, 1 failed." in tests_summary(log)


def test_the_tests_the_cap_stopped_are_written_for_the_next_run(tmp_path) -> None:
    """Of the collected ids, those with no outcome in the log (not started, or started and cut off) go to
    the rest file, one a line, in collection order; ids with spaces in their brackets, both pytest formats."""
    from specstack.gpu_check import outcomes_in_log, tests_summary

    collected = ["tests/a.py::t[cpu]", "tests/a.py::t[ x:1 -p6]", "tests/b.py::u", "tests/b.py::v", "tests/c.py::w"]
    log = tmp_path / "gpu-tests.log"
    log.write_text("tests/b.py::u \n[gw1] [ 20%] PASSED tests/a.py::t[ x:1 -p6] \n[gw0] [ 40%] FAILED tests/a.py::t[cpu] \n"
                   "tests/c.py::w PASSED                                  [ 60%]\n"
                   "!!!! KeyboardInterrupt !!!!\n==== 1 failed, 2 passed in 3.0s ====\n")
    assert outcomes_in_log(log.read_text().splitlines()) == {"tests/a.py::t[ x:1 -p6]": "PASSED", "tests/a.py::t[cpu]": "FAILED", "tests/c.py::w": "PASSED"}
    rest = tmp_path / "gpu-tests.rest"
    text = tests_summary(log, collected, rest)
    assert rest.read_text().splitlines() == ["tests/b.py::u", "tests/b.py::v"]  # u started but was cut off; v never started
    assert "2 passed, 1 failed, then the time cap" in text and f"5 tests collected, 2 did not run to the end (`make gpu-check GPU_TESTS=@{rest}`" in text
    assert "- FAILED tests/a.py::t[cpu]" in text


def test_the_gpu_tests_start_slowest_first_by_their_recorded_seconds() -> None:
    """A test's setup, call and teardown lines add up; tests with no line keep their order after the recorded
    ones; lines that are not durations are ignored."""
    from specstack.gpu_check import recorded_seconds, slowest_first

    lines = ["# a comment", "145.54s call     tests/a.py::slow[x y]", "36.93s setup    tests/b.py::fixture_heavy",
             "2.00s call     tests/b.py::fixture_heavy", "0.50s teardown tests/a.py::slow[x y]",
             "(12 durations < 0.005s hidden.  Use -vv to show these durations.)", "============ 3 passed in 9.1s ============"]
    seconds = recorded_seconds(lines)
    assert seconds == {"tests/a.py::slow[x y]": 146.04, "tests/b.py::fixture_heavy": 38.93}
    collected = ["tests/c.py::quick", "tests/b.py::fixture_heavy", "tests/c.py::other", "tests/a.py::slow[x y]"]
    assert slowest_first(collected, seconds) == ["tests/a.py::slow[x y]", "tests/b.py::fixture_heavy", "tests/c.py::quick", "tests/c.py::other"]


def test_the_shipped_durations_name_tests_that_exist() -> None:
    """tests/gpu-durations.txt orders make gpu-check's tests: a renamed test would silently lose its place."""
    from pathlib import Path

    from specstack.gpu_check import recorded_seconds

    recorded = recorded_seconds((Path(__file__).with_name("gpu-durations.txt")).read_text().splitlines())
    assert len(recorded) >= 30
    for test in recorded:
        path, _, name = test.partition("::")
        source = (Path(__file__).parent.parent / path).read_text()
        assert f"def {name.split('[')[0]}(" in source, test
