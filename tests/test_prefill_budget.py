"""The per-step prefill budget adapted from the step times the decode loop sees (prefill_budget.py)."""

from __future__ import annotations

import pytest

from engine_service.prefill_budget import IDLE_PRIOR, MIN_TOKENS, STALL_FACTOR, START_TOKENS, PrefillBudget


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


def test_the_idle_prefill_cost_stands_in_until_a_mixed_step_is_timed() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    budget.observe(0, 500, 0.500)  # 1 ms a token with nothing decoding
    assert budget.tokens(8) == int((STALL_FACTOR - 1) * 0.040 / (0.001 * IDLE_PRIOR))


def test_a_step_that_prefills_stays_within_the_stall_factor_of_a_decode_step() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    budget.observe(8, 100, 0.040 + 100 * 0.0005)  # 0.5 ms a token beside 8 rows
    tokens = budget.tokens(8)
    assert tokens == int((STALL_FACTOR - 1) * 0.040 / 0.0005) == 160
    # the step it plans takes STALL_FACTOR decode steps
    assert 0.040 + tokens * 0.0005 == pytest.approx(STALL_FACTOR * 0.040)


def test_slower_machines_get_fewer_tokens_and_the_bounds_hold() -> None:
    fast, slow = PrefillBudget(None, 4096), PrefillBudget(None, 4096)
    for budget, decode, per_token in ((fast, 0.035, 0.0008), (slow, 0.165, 0.012)):
        budget.observe(8, 0, decode)
        budget.observe(8, 64, decode + 64 * per_token)
    assert slow.tokens(8) < fast.tokens(8)
    tiny = PrefillBudget(None, 4096)
    tiny.observe(1, 0, 0.001)
    tiny.observe(1, 64, 0.001 + 64 * 0.01)
    assert tiny.tokens(1) == MIN_TOKENS
    huge = PrefillBudget(None, 300)
    huge.observe(1, 0, 1.0)
    huge.observe(1, 10, 1.0 + 10 * 1e-6)
    assert huge.tokens(1) == 300


def test_moving_averages_follow_the_measurements_and_the_nearest_row_count_serves() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(4, 0, 0.020)
    budget.observe(4, 0, 0.030)  # averaged: 0.020 + 0.3 * 0.010
    budget.observe(4, 50, 0.023 + 50 * 0.001)
    assert budget.describe()["decode_ms"] == {4: 23.0}
    assert budget.describe()["token_ms_mixed"] == 1.0
    assert budget.tokens(5) == budget.tokens(4) in (45, 46)  # 2 x 23 ms / 1 ms, as floats round
    budget.observe(16, 0, 0.050)
    assert budget.tokens(15) in (99, 100)  # 2 x 50 ms / 1 ms: 16 is nearer than 4
    # a prefill step beside a row count never timed is measured against the nearest one
    budget.observe(15, 10, 0.050 + 10 * 0.003)
    assert budget.describe()["token_ms_mixed"] == pytest.approx(1.0 + 0.3 * 2.0)
