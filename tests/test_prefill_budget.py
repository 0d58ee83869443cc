"""The per-step prefill budget adapted from the step times the decode loop sees (prefill_budget.py):
(STALL_FACTOR - 1) decode-only steps' worth of prompt tokens, each taken to cost CHUNK_COST idle ones."""

from __future__ import annotations

from engine_service.scheduling.prefill_budget import (
    CHUNK_COST,
    MIN_TOKENS,
    STALL_FACTOR,
    START_TOKENS,
    PrefillBudget,
)


def expected(decode: float, token_idle: float) -> int:
    return int((STALL_FACTOR - 1) * decode / (CHUNK_COST * token_idle))


def test_a_fixed_budget_ignores_the_step_times() -> None:
    budget = PrefillBudget(96, 2048)
    budget.observe(8, 0, 0.030)
    budget.observe(0, 96, 1.0)
    assert budget.tokens(8) == 96


def test_before_both_costs_are_timed_the_start_budget_serves() -> None:
    budget = PrefillBudget(None, 2048)
    assert budget.tokens(8) == START_TOKENS
    budget.observe(8, 0, 0.030)  # a decode step, but no prefill cost yet
    assert budget.tokens(8) == START_TOKENS
    budget = PrefillBudget(None, 2048)
    budget.observe(0, 500, 0.500)  # a prefill cost, but no decode step yet
    assert budget.tokens(8) == START_TOKENS


def test_the_budget_is_stall_factor_decode_steps_of_chunk_tokens() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    budget.observe(0, 500, 0.500)  # 1 ms a token with nothing decoding
    assert budget.tokens(8) == expected(0.040, 0.001) > MIN_TOKENS
    budget.observe(8, 64, 5.0)  # a step that prefills beside decoding rows changes neither cost
    assert budget.tokens(8) == expected(0.040, 0.001)


def test_the_budget_stays_within_its_floor_and_max_tokens() -> None:
    budget = PrefillBudget(None, 300)
    budget.observe(1, 0, 0.010)
    budget.observe(0, 100, 10.0)  # 100 ms a token: a fraction of one token fits
    assert budget.tokens(1) == MIN_TOKENS
    budget = PrefillBudget(None, 300)
    budget.observe(1, 0, 1.0)
    budget.observe(0, 100, 0.001)  # 10 us a token: far more than max_tokens fit
    assert budget.tokens(1) == 300


def test_the_decode_step_of_the_nearest_row_count_serves_and_averages_move() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(4, 0, 0.020)
    budget.observe(4, 0, 0.030)  # averaged: 0.020 + 0.3 * 0.010
    budget.observe(16, 0, 0.050)
    budget.observe(0, 0, 9.0)  # a step that ran nothing times nothing
    assert budget.describe()["decode_ms"] == {4: 23.0, 16: 50.0}
    budget.observe(0, 1000, 0.100)  # 0.1 ms a token
    assert budget.tokens(15) == expected(0.050, 0.0001)  # nearest: 16 rows
    assert budget.tokens(5) == expected(0.023, 0.0001)  # nearest: 4 rows
    assert budget.tokens(10) == expected(0.023, 0.0001)  # 6 from either: the fewer rows
    assert budget.tokens(16) == expected(0.050, 0.0001)


# -- found by `make mutate` (docs/mutation-testing.md) -------------------------------------------

def test_describe_gives_each_estimate_in_milliseconds_to_the_microsecond() -> None:
    budget = PrefillBudget(None, 4096)
    assert budget.describe() == {"fixed": None, "token_ms_idle": None, "decode_ms": {}}
    budget.observe(0, 1000, 1.2345678)  # 1.2345678 ms a token
    budget.observe(3, 0, 0.0456789)
    assert budget.describe() == {"fixed": None, "token_ms_idle": 1.235, "decode_ms": {3: 45.679}}
    assert PrefillBudget(96, 4096).describe()["fixed"] == 96


def test_the_idle_prefill_cost_is_a_moving_average() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(0, 100, 0.100)  # 1 ms a token
    budget.observe(0, 100, 0.200)  # 2 ms a token: 1 + 0.3 x (2 - 1)
    assert budget.describe()["token_ms_idle"] == 1.3


def test_an_idle_prefill_timed_at_zero_seconds_leaves_the_start_budget() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, 0, 0.040)
    budget.observe(0, 100, 0.0)  # a clock too coarse to see it: no cost per token to divide by
    assert budget.tokens(8) == START_TOKENS
