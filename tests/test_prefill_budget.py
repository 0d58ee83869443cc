"""The per-step prefill budget adapted from the step times the decode loop sees (prefill_budget.py)."""

from __future__ import annotations

import pytest

from engine_service.prefill_budget import (
    IDLE_PRIOR,
    MAX_GROWTH,
    MIN_TOKENS,
    STALL_FACTOR,
    START_TOKENS,
    PrefillBudget,
)


def test_a_fixed_budget_ignores_the_step_times() -> None:
    budget = PrefillBudget(96, 2048)
    budget.observe(8, 0, 0.030)
    budget.observe(8, 96, 1.0)
    assert budget.tokens(8) == 96


def test_before_anything_is_timed_the_start_budget_serves() -> None:
    budget = PrefillBudget(None, 2048)
    assert budget.tokens(8) == START_TOKENS
    budget.observe(8, 0, 0.030)  # a decode step, but no prefill cost yet
    assert budget.tokens(8) == START_TOKENS
    budget.observe(8, 50, 0.2)  # a prefilling step with no decode step timed at any row count: no feedback
    assert PrefillBudget(None, 2048).tokens(1) == START_TOKENS


def test_the_idle_prefill_cost_stands_in_until_a_prefilling_step_is_timed() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    budget.observe(0, 500, 0.500)  # 1 ms a token with nothing decoding
    assert budget.tokens(8) == int((STALL_FACTOR - 1) * 0.040 / (0.001 * IDLE_PRIOR)) == 40


def affine(fixed: float, per_token: float, decode: float = 0.040):  # type: ignore[no-untyped-def]
    """A machine whose prefilling step costs decode + fixed + per_token x tokens."""
    return lambda tokens: decode + fixed + per_token * tokens


@pytest.mark.parametrize(("fixed", "per_token"), [(0.0, 0.0005), (0.030, 0.0005), (0.010, 0.004), (0.0, 0.00001)])
def test_the_feedback_settles_where_a_prefilling_step_takes_stall_factor_decode_steps(
        fixed: float, per_token: float) -> None:
    step = affine(fixed, per_token)
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    for _ in range(40):
        tokens = budget.tokens(8)
        budget.observe(8, tokens, step(tokens))
    settled = budget.tokens(8)
    wanted = min(4096, ((STALL_FACTOR - 1) * 0.040 - fixed) / per_token)
    assert settled == pytest.approx(wanted, rel=0.05, abs=2)
    if wanted < 4096:
        assert step(settled) == pytest.approx(STALL_FACTOR * 0.040, rel=0.05)


def test_the_budget_at_most_doubles_a_step_and_stays_within_its_bounds() -> None:
    budget = PrefillBudget(None, 300)
    budget.observe(1, 0, 0.010)
    budget.observe(1, 20, 0.010)  # no excess at all
    assert budget.tokens(1) == int(20 * MAX_GROWTH)
    for _ in range(10):
        budget.observe(1, budget.tokens(1), 0.010)
    assert budget.tokens(1) == 300  # capped at max_tokens
    budget.observe(1, 300, 100.0)  # far over the target
    assert MIN_TOKENS <= budget.tokens(1) < 300
    for _ in range(20):
        budget.observe(1, budget.tokens(1), 100.0)
    assert budget.tokens(1) == MIN_TOKENS


def test_a_fixed_cost_above_the_target_shrinks_the_budget_to_its_floor() -> None:
    step = affine(fixed=0.200, per_token=0.001)  # the fixed part alone exceeds 2 decode steps
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    for _ in range(30):
        budget.observe(8, budget.tokens(8), step(budget.tokens(8)))
    assert budget.tokens(8) == MIN_TOKENS


def test_the_decode_step_of_the_nearest_row_count_serves_and_averages_move() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(4, 0, 0.020)
    budget.observe(4, 0, 0.030)  # averaged: 0.020 + 0.3 * 0.010
    budget.observe(16, 0, 0.050)
    assert budget.describe()["decode_ms"] == {4: 23.0, 16: 50.0}
    # a prefilling step beside 15 rows is measured against 16's decode step: excess 100 ms = the target
    budget.observe(15, 64, 0.050 + (STALL_FACTOR - 1) * 0.050)
    assert budget.tokens(15) == 64
    # beside 5 rows, against 4's (23 ms): the same step is far over the target
    budget.observe(5, 64, 0.050 + (STALL_FACTOR - 1) * 0.050)
    assert budget.tokens(5) == int(64 * ((STALL_FACTOR - 1) * 0.023 / (0.050 + 0.100 - 0.023)) ** 0.5)
    assert budget.describe()["fed"] == budget.tokens(5)
