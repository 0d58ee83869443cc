"""The per-step prefill budget adapted from the step times the decode loop sees (prefill_budget.py):
(STALL_FACTOR - 1) decode-only steps' worth of prompt tokens, each taken to cost CHUNK_COST idle ones,
a token at position p weighing 1 + p / parity (attention_parity)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_service.model.kv_cache import PromptChunk
from engine_service.model.presets import PRESETS
from engine_service.scheduling.prefill_budget import (
    CHUNK_COST,
    MAX_CHUNK_COST,
    MIN_CHUNK_COST,
    MIN_TOKENS,
    SMOOTHING,
    STALL_FACTOR,
    START_TOKENS,
    PrefillBudget,
    attention_parity,
)


def idle(*lengths: int, start: int = 0) -> list[PromptChunk]:
    """Whole prompts prefilled with nothing decoding, one row each."""
    return [PromptChunk(row, start, n) for row, n in enumerate(lengths)]


NONE: list[PromptChunk] = []  # a decode-only step


def expected(decode: float, token_idle: float) -> int:
    return int((STALL_FACTOR - 1) * decode / (CHUNK_COST * token_idle))


def test_a_fixed_budget_ignores_the_step_times() -> None:
    budget = PrefillBudget(96, 2048)
    budget.observe(8, NONE, 0.030)
    budget.observe(0, idle(96), 1.0)
    assert budget.tokens(8, 0) == 96


def test_before_both_costs_are_timed_the_start_budget_serves() -> None:
    budget = PrefillBudget(None, 2048)
    assert budget.tokens(8, 0) == START_TOKENS
    budget.observe(8, NONE, 0.030)  # a decode step, but no prefill cost yet
    assert budget.tokens(8, 0) == START_TOKENS
    budget = PrefillBudget(None, 2048)
    budget.observe(0, idle(500), 0.500)  # a prefill cost, but no decode step yet
    assert budget.tokens(8, 0) == START_TOKENS


def test_the_budget_is_stall_factor_decode_steps_of_chunk_tokens() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(500), 0.500)  # 1 ms a token with nothing decoding
    assert budget.tokens(8, 0) == expected(0.040, 0.001) > MIN_TOKENS
    budget.observe(8, [PromptChunk(8, 0, 64)], 0.040 + 64 * CHUNK_COST * 0.001)  # a mixed step as estimated
    assert budget.tokens(8, 0) == expected(0.040, 0.001)


def test_a_mixed_steps_time_beyond_a_decode_step_teaches_the_chunk_cost() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(500), 0.500)  # 1 ms a token idle
    budget.observe(8, [PromptChunk(8, 0, 50)], 0.040 + 0.150)  # 50 tokens beside 8 rows: 3 ms each, 3 idle ones
    learned = CHUNK_COST + SMOOTHING * (3.0 - CHUNK_COST)
    assert budget.describe()["chunk_cost"] == {8: round(learned, 3)}
    assert budget.tokens(8, 0) == int((STALL_FACTOR - 1) * 0.040 / (learned * 0.001))
    assert budget.tokens(8, 0) < expected(0.040, 0.001)  # dearer chunk tokens: smaller chunks


def test_each_number_of_decoding_rows_learns_its_own_chunk_cost() -> None:
    # beside 8 rows a mixed step leaves the int4 copies the decode-only step runs on; beside 16 it does not
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, 0.030)
    budget.observe(16, NONE, 0.050)
    budget.observe(0, idle(500), 0.500)  # 1 ms a token idle
    for _ in range(40):
        budget.observe(8, [PromptChunk(8, 0, 20)], 0.030 + 20 * 0.0035)  # 3.5 idle tokens a chunk token
        budget.observe(16, [PromptChunk(16, 0, 100)], 0.050 + 100 * 0.0011)  # 1.1
    costs = budget.describe()["chunk_cost"]
    assert costs == {8: pytest.approx(3.5, abs=1e-3), 16: pytest.approx(1.1, abs=1e-3)}
    assert budget.tokens(8, 0) == int(2.5 * 0.030 / (costs[8] * 0.001)) > MIN_TOKENS
    assert budget.tokens(16, 0) == int(2.5 * 0.050 / (costs[16] * 0.001))
    # 12 rows: the decode step of the nearer-and-fewer row count (8), the chunk cost not yet timed: the prior
    assert budget.tokens(12, 0) == int(2.5 * 0.030 / (CHUNK_COST * 0.001))


def test_a_chunk_at_a_later_position_is_counted_by_its_weight() -> None:
    budget = PrefillBudget(None, 4096, parity=1000.0)
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(100), 0.100)  # 1 ms a token at position 0 (weight 1.0495 a token: 100 at 0..99)
    idle_token = 0.100 / budget.weight(idle(100))
    chunk = [PromptChunk(8, 1000, 20)]  # weight 20 x (1 + 1009.5 / 1000)
    budget.observe(8, chunk, 0.040 + 2 * budget.weight(chunk) * idle_token)
    assert budget.describe()["chunk_cost"] == {8: round(CHUNK_COST + SMOOTHING * (2 - CHUNK_COST), 3)}


@pytest.mark.parametrize(("extra", "cost"), [(0.0, MIN_CHUNK_COST), (-0.010, MIN_CHUNK_COST), (10.0, MAX_CHUNK_COST)])
def test_the_learned_chunk_cost_is_held_within_its_bounds(extra: float, cost: float) -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(500), 0.500)
    for _ in range(60):  # a step no dearer than a decode step, or a stall of seconds, again and again
        budget.observe(8, [PromptChunk(8, 0, 50)], 0.040 + extra)
    assert budget.describe()["chunk_cost"] == {8: pytest.approx(cost, abs=1e-3)}


def test_a_mixed_step_before_both_costs_are_timed_teaches_nothing() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, [PromptChunk(8, 0, 50)], 1.0)  # neither cost yet
    budget.observe(8, NONE, 0.040)
    budget.observe(8, [PromptChunk(8, 0, 50)], 1.0)  # no idle cost yet
    assert budget.describe()["chunk_cost"] == {}
    budget.observe(0, idle(500), 0.0)  # an idle prefill timed at zero: no cost to count against
    budget.observe(8, [PromptChunk(8, 0, 50)], 1.0)
    assert budget.describe()["chunk_cost"] == {}


def test_with_a_fixed_part_the_chunks_settle_where_the_step_takes_its_target() -> None:
    # a mixed step costs F + T c idle-token-seconds: the learned cost folds F in, and the chunks
    # settle where the step is STALL_FACTOR decode steps, (target - F) / c tokens
    decode, token_idle, fixed, c = 0.030, 0.0005, 0.020, 2.0
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, decode)
    budget.observe(0, idle(1000), 1000 * token_idle)
    for _ in range(80):
        tokens = budget.tokens(8, 0)
        budget.observe(8, [PromptChunk(8, 0, tokens)], decode + fixed + tokens * c * token_idle)
    settled = ((STALL_FACTOR - 1) * decode - fixed) / (c * token_idle)  # 55 tokens
    assert abs(budget.tokens(8, 0) - settled) <= 1


def test_the_budget_stays_within_its_floor_and_max_tokens() -> None:
    budget = PrefillBudget(None, 300)
    budget.observe(1, NONE, 0.010)
    budget.observe(0, idle(100), 10.0)  # 100 ms a token: a fraction of one token fits
    assert budget.tokens(1, 0) == MIN_TOKENS
    budget = PrefillBudget(None, 300)
    budget.observe(1, NONE, 1.0)
    budget.observe(0, idle(100), 0.001)  # 10 us a token: far more than max_tokens fit
    assert budget.tokens(1, 0) == 300


def test_the_decode_step_of_the_nearest_row_count_serves_and_averages_move() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(4, NONE, 0.020)
    budget.observe(4, NONE, 0.030)  # averaged: 0.020 + 0.3 * 0.010
    budget.observe(16, NONE, 0.050)
    budget.observe(0, NONE, 9.0)  # a step that ran nothing times nothing
    assert budget.describe()["decode_ms"] == {4: 23.0, 16: 50.0}
    budget.observe(0, idle(1000), 0.100)  # 0.1 ms a token
    assert budget.tokens(15, 0) == expected(0.050, 0.0001)  # nearest: 16 rows
    assert budget.tokens(5, 0) == expected(0.023, 0.0001)  # nearest: 4 rows
    assert budget.tokens(10, 0) == expected(0.023, 0.0001)  # 6 from either: the fewer rows
    assert budget.tokens(16, 0) == expected(0.050, 0.0001)


# -- found by `make mutate` (docs/mutation-testing.md) -------------------------------------------

def test_describe_gives_each_estimate_in_milliseconds_to_the_microsecond() -> None:
    budget = PrefillBudget(None, 4096)
    assert budget.describe() == {"fixed": None, "parity": None, "token_ms_idle": None, "chunk_cost": {},
                                 "decode_ms": {}}
    budget.observe(0, idle(1000), 1.2345678)  # 1.2345678 ms a token
    budget.observe(3, NONE, 0.0456789)
    budget.observe(3, [PromptChunk(3, 0, 10)], 0.0456789 + 10 * 2.1254567 * 0.0012345678)
    chunk_cost = round(CHUNK_COST + SMOOTHING * (2.1254567 - CHUNK_COST), 3)  # 1.68763701: 1.688, not 1.6876
    assert budget.describe() == {"fixed": None, "parity": None, "token_ms_idle": 1.235, "chunk_cost": {3: chunk_cost},
                                 "decode_ms": {3: 45.679}}
    assert PrefillBudget(None, 4096, parity=3072.0).describe()["parity"] == 3072.0
    assert PrefillBudget(96, 4096).describe()["fixed"] == 96


def test_the_idle_prefill_cost_is_a_moving_average() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(0, idle(100), 0.100)  # 1 ms a token
    budget.observe(0, idle(100), 0.200)  # 2 ms a token: 1 + 0.3 x (2 - 1)
    assert budget.describe()["token_ms_idle"] == 1.3


def test_an_idle_prefill_timed_at_zero_seconds_leaves_the_start_budget() -> None:
    budget = PrefillBudget(None, 4096)
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(100), 0.0)  # a clock too coarse to see it: no cost per token to divide by
    assert budget.tokens(8, 0) == START_TOKENS


# -- the position a chunk starts at ------------------------------------------------------------

def test_smollm2s_attention_parity_is_its_matmul_flops_over_attentions_per_position() -> None:
    # q/k/v 576 x (9 + 2 x 3) x 64, o 576 x 576, gate/up/down 3 x 576 x 1,536: 3,538,944 weights,
    # 2 FLOPs each; attention 4 x 9 heads x 64 a position
    smollm2 = replace(PRESETS["small"], name="smollm2", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536)
    assert attention_parity(smollm2) == 2 * 3_538_944 / (4 * 9 * 64) == 3072.0
    assert attention_parity(replace(smollm2, head_dim=128)) == pytest.approx(
        2 * (576 * 15 * 128 + 9 * 128 * 576 + 3 * 576 * 1536) / (4 * 9 * 128))  # a head_dim of its own


def test_a_chunks_tokens_weigh_one_plus_their_mean_position_over_parity() -> None:
    budget = PrefillBudget(None, 4096, parity=100.0)
    assert budget.weight([PromptChunk(0, 0, 1)]) == 1.0  # one token at position 0
    assert budget.weight([PromptChunk(0, 50, 3)]) == pytest.approx(3 * (1 + 51 / 100))  # positions 50, 51, 52
    assert budget.weight([PromptChunk(0, 0, 4), PromptChunk(1, 200, 2)]) == pytest.approx(
        4 * (1 + 1.5 / 100) + 2 * (1 + 200.5 / 100))
    assert PrefillBudget(None, 4096).weight([PromptChunk(0, 1000, 7)]) == 7  # parity inf: every token weighs 1


def test_an_idle_prefills_cost_is_per_token_at_position_0() -> None:
    budget = PrefillBudget(None, 4096, parity=1000.0)
    budget.observe(0, idle(1000), 1.5)  # weight 1000 x (1 + 499.5 / 1000) = 1,499.5
    assert budget.describe()["token_ms_idle"] == round(1.5 / 1499.5 * 1000, 3)
    budget = PrefillBudget(None, 4096, parity=1000.0)
    budget.observe(0, idle(100, 100, start=900), 1.0)  # two prompts past a cached 900: 200 x (1 + 949.5 / 1000)
    assert budget.describe()["token_ms_idle"] == round(1.0 / 389.9 * 1000, 3)


def test_a_later_chunk_gets_the_tokens_whose_weight_the_budget_buys() -> None:
    budget = PrefillBudget(None, 4096, parity=3072.0)
    budget.observe(8, NONE, 0.030)
    budget.observe(0, idle(100), 0.100)  # 1 ms a token at about position 0 (50 / 3,072 more)
    buys = (STALL_FACTOR - 1) * 0.030 / (CHUNK_COST * budget.describe()["token_ms_idle"] / 1000)
    got = [budget.tokens(8, position) for position in (0, 500, 1000, 1950)]
    assert got == sorted(got, reverse=True) and got[0] > got[-1] >= MIN_TOKENS
    for position, tokens in zip((0, 500, 1000, 1950), got, strict=True):
        assert budget.weight([PromptChunk(8, position, tokens)]) <= buys < budget.weight([PromptChunk(8, position, tokens + 1)])
    assert got[0] in (int(buys), int(buys) - 1)  # position 0: about one token per token bought
    assert got == [50, 43, 38, 30]  # 2.5 decode steps of 30 ms buy 50.8 tokens at position 0: fewer later


@given(weight=st.floats(0.5, 1e5), position=st.integers(0, 1 << 20), parity=st.floats(1.0, 1e7))
def test_fitting_inverts_weight(weight: float, position: int, parity: float) -> None:
    budget = PrefillBudget(None, 1 << 30, parity=parity)
    tokens = budget._fitting(weight, position)
    u = 1 + (position - 0.5) / parity
    assert tokens * tokens / (2 * parity) + tokens * u == pytest.approx(weight, rel=1e-9)


def test_without_parity_a_chunks_position_changes_nothing() -> None:
    budget = PrefillBudget(None, 4096)
    assert budget.parity == math.inf
    budget.observe(8, NONE, 0.040)
    budget.observe(0, idle(500), 0.500)
    assert budget.tokens(8, 0) == budget.tokens(8, 100_000) == expected(0.040, 0.001)


def test_late_chunks_stop_at_the_floor() -> None:
    budget = PrefillBudget(None, 4096, parity=100.0)
    budget.observe(8, NONE, 0.030)
    budget.observe(0, idle(10), 0.010)
    assert budget.tokens(8, 0) > MIN_TOKENS
    assert budget.tokens(8, 1_000_000) == MIN_TOKENS


def test_plain_seconds_are_a_decode_only_steps_at_exactly_that_row_count() -> None:
    budget = PrefillBudget(None, 2048)
    assert budget.plain_seconds(2) is None
    budget.observe(2, [], 0.010)
    budget.observe(4, [], 0.020)
    budget.observe(2, [PromptChunk(1, 0, 8)], 0.050)  # a mixed step: not a plain one
    assert budget.plain_seconds(2) == 0.010 and budget.plain_seconds(4) == 0.020
    assert budget.plain_seconds(3) is None  # no nearest row count stands in
