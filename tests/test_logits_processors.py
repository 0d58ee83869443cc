"""engine_service/generation/logits_processors.py and min-p in engine_service/generation/sampler.py, each against its
definition: transformers' own processors (RepetitionPenaltyLogitsProcessor,
MinNewTokensLengthLogitsProcessor, and TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper in generate's order) on the same random logits, and OpenAI's
published presence/frequency formula written out below. Then the batch: unprocessed rows
bit-identical, the caller's tensor never written, the same object back when no row is processed;
the order of the four steps; the min_new_tokens boundary; logit_bias at -100 and 100;
Penalties.add kept incrementally equal to a recount; in_place; bfloat16 rows; ids of any integer
type; float32 state whatever torch's default dtype; and every tensor on the sequence's device (on
a stand-in accelerator, `Accelerator`, since these machines may have none). In-process,
milliseconds each."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine_service.generation.logits_processors import Penalties, process
from engine_service.generation.sampler import new_generator, sample, warped_probs
from engine_service.requests import SamplingParams

CPU = torch.device("cpu")
META = torch.device("meta")
VOCAB = 97
INF = float("inf")
PLAIN = SamplingParams()


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits of both signs, with a few exact zeros (where the repetition penalty's branch turns)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    logits[:, ::13] = 0.0
    return logits


def random_ids(count: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """Token ids with repeats (drawn from a third of the vocabulary)."""
    return torch.randint(0, vocab // 3, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_row(logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None = None, generated: int = 0,
            banned: frozenset[int] = frozenset()) -> torch.Tensor:
    return process(logits[None], [params], [penalties], [generated], [banned])[0]


def penalties_for(prompt: list[int], output: list[int], vocab: int = VOCAB) -> Penalties:
    state = Penalties(prompt, vocab, CPU)
    state.add(output)
    return state


class Accelerator(TorchDispatchMode):
    """A stand-in accelerator for a machine without one: tensors on the meta device (shapes, no
    data) where, as on CUDA, no op may take tensors of two devices (a 0-dim host scalar aside), so
    a tensor made on the host by mistake fails the op that meets it; a read back to the host (the
    `tolist` at the end of a step) gives zeros."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device == META and kwargs.get("device") == CPU:
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            raise AssertionError(f"{func} takes tensors of {sorted(map(str, devices))}")
        return func(*args, **kwargs)


# --- repetition penalty -------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0, 1e-3])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty: float) -> None:
    logits = random_logits(4, seed=1)
    for row in range(4):
        prompt, output = random_ids(20, seed=10 + row), random_ids(7, seed=20 + row)
        params = SamplingParams(repetition_penalty=penalty)
        got = one_row(logits[row], params, penalties_for(prompt, output))
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[row : row + 1])[0]
        assert torch.equal(got, want)
        seen = set(prompt + output)
        assert got[sorted(seen)].ne(logits[row, sorted(seen)]).sum() > 0
        unseen = sorted(set(range(VOCAB)) - seen)
        assert torch.equal(got[unseen], logits[row, unseen])


def test_repetition_penalty_branches_on_the_sign_once_per_token() -> None:
    logits = torch.tensor([3.0, -3.0, 0.0, 5.0, -5.0])
    state = penalties_for([0, 1, 2, 0, 0], [1, 1, 0], vocab=5)  # token 0 seen four times: penalised once
    got = one_row(logits, SamplingParams(repetition_penalty=1.5), state)
    assert got.tolist() == [2.0, -4.5, 0.0, 5.0, -5.0]
    got = one_row(logits, SamplingParams(repetition_penalty=0.5), state)
    assert got.tolist() == [6.0, -1.5, 0.0, 5.0, -5.0]


def test_repetition_penalty_alone_reads_no_counts() -> None:
    # a token seen only in the prompt: the repetition penalty applies, presence and frequency do not
    logits = torch.tensor([2.0, 2.0, 2.0])
    state = penalties_for([0], [1], vocab=3)
    got = one_row(logits, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), state)
    assert got.tolist() == [1.0, 1.0 - 0.75, 2.0]


# --- presence and frequency (OpenAI) ------------------------------------------------------------

def openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """platform.openai.com/docs/advanced-usage, "Frequency and presence penalties":
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    mu = logits.tolist()
    for j, c in Counter(output).items():
        mu[j] = mu[j] - c * frequency - float(c > 0) * presence
    return torch.tensor(mu, dtype=torch.float32)


@settings(max_examples=40, deadline=None)
@given(presence=st.floats(-2.0, 2.0), frequency=st.floats(-2.0, 2.0),
       output=st.lists(st.integers(0, VOCAB - 1), max_size=30), seed=st.integers(0, 2**16))
def test_presence_and_frequency_are_openais_formula_over_the_output(presence: float, frequency: float,
                                                                     output: list[int], seed: int) -> None:
    logits = random_logits(1, seed)[0]
    prompt = random_ids(15, seed)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    got = one_row(logits, params, penalties_for(prompt, output))
    torch.testing.assert_close(got, openai_penalties(logits, output, presence, frequency), rtol=1e-6, atol=2e-6)
    untouched = sorted(set(range(VOCAB)) - set(output))  # the prompt's tokens included
    assert torch.equal(got[untouched], logits[untouched])


def test_presence_and_frequency_exact_values() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    state = penalties_for([3, 3], [0, 1, 1, 1], vocab=4)
    assert one_row(logits, SamplingParams(presence_penalty=0.5), state).tolist() == [0.5, 0.5, 1.0, 1.0]
    assert one_row(logits, SamplingParams(frequency_penalty=0.25), state).tolist() == [0.75, 0.25, 1.0, 1.0]
    both = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert one_row(logits, both, state).tolist() == [0.25, -0.25, 1.0, 1.0]
    negative = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    assert one_row(logits, negative, state).tolist() == [2.5, 3.5, 1.0, 1.0]
    assert one_row(logits, SamplingParams(frequency_penalty=1.0), state).tolist() == [0.0, -2.0, 1.0, 1.0]
    assert one_row(logits, SamplingParams(presence_penalty=1.0), state).tolist() == [0.0, 0.0, 1.0, 1.0]


# --- min_new_tokens -----------------------------------------------------------------------------

@pytest.mark.parametrize("min_new", [1, 3])
def test_min_new_tokens_is_transformers(min_new: int) -> None:
    logits = random_logits(1, seed=3)[0]
    prompt, eos = random_ids(9, seed=4), frozenset({2, 50, 96})
    params = SamplingParams(min_new_tokens=min_new)
    for generated in range(min_new + 2):
        ids = torch.tensor([prompt + random_ids(generated, seed=5)])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), min_new, sorted(eos))(ids, logits[None])[0]
        assert torch.equal(one_row(logits, params, generated=generated, banned=eos), want)


def test_min_new_tokens_boundary() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params, eos = SamplingParams(min_new_tokens=5), frozenset({1, 3})
    assert one_row(logits, params, generated=0, banned=eos).tolist() == [1.0, -INF, 3.0, -INF]
    assert one_row(logits, params, generated=4, banned=eos).tolist() == [1.0, -INF, 3.0, -INF]
    assert one_row(logits, params, generated=5, banned=eos).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert one_row(logits, params, generated=6, banned=eos).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert one_row(logits, params, generated=0, banned=frozenset()).tolist() == [1.0, 2.0, 3.0, 4.0]


# --- logit_bias ---------------------------------------------------------------------------------

def test_logit_bias_adds_to_the_named_ids_only() -> None:
    logits = random_logits(1, seed=6)[0]
    bias = ((0, -100.0), (5, 100.0), (12, 0.3), (96, -2.5))
    got = one_row(logits, SamplingParams(logit_bias=bias))
    for token, value in bias:
        assert got[token] == logits[token] + torch.tensor(value, dtype=torch.float32)
    others = sorted(set(range(VOCAB)) - {t for t, _ in bias})
    assert torch.equal(got[others], logits[others])


def test_logit_bias_edges() -> None:
    logits = torch.tensor([0.5, -0.5, 7.0])
    got = one_row(logits, SamplingParams(logit_bias=((0, -100.0), (1, 100.0), (2, 0.0))))
    assert got.tolist() == [-99.5, 99.5, 7.0]
    assert got.argmax() == 1
    assert torch.softmax(got, -1)[0] < 1e-40


# --- the order of the steps ---------------------------------------------------------------------

def test_bias_comes_before_the_mask_and_the_repetition_penalty() -> None:
    logits = torch.tensor([-2.0, 1.0, 1.0])
    params = SamplingParams(logit_bias=((0, 3.0), (1, 100.0)), min_new_tokens=2, repetition_penalty=2.0)
    got = one_row(logits, params, penalties_for([0], [], vocab=3), generated=1, banned=frozenset({1}))
    # bias first: (-2 + 3) / 2 = 0.5 (the penalty first would give -4 + 3 = -1); the mask wins over +100
    assert got.tolist() == [0.5, -INF, 1.0]


def test_repetition_penalty_comes_before_presence() -> None:
    logits = torch.tensor([3.0, 3.0])
    got = one_row(logits, SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), penalties_for([], [0], vocab=2))
    assert got.tolist() == [0.5, 3.0]  # 3 / 2 - 1 (presence first: (3 - 1) / 2 = 1)


# --- the batch ----------------------------------------------------------------------------------

def test_a_batch_with_no_processed_row_is_returned_as_it_is() -> None:
    logits = random_logits(3, seed=7)
    params = [PLAIN, SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1), SamplingParams(min_new_tokens=0)]
    assert process(logits, params, [None] * 3, [0, 5, 9], [frozenset({1})] * 3) is logits


def test_a_mixed_batch_touches_only_the_processed_rows_and_never_the_input() -> None:
    logits = random_logits(6, seed=8)
    before = logits.clone()
    params = [PLAIN, SamplingParams(repetition_penalty=1.4, presence_penalty=0.3), SamplingParams(temperature=0.9),
              SamplingParams(logit_bias=((4, 5.0),)), SamplingParams(min_new_tokens=2),
              SamplingParams(min_new_tokens=2, temperature=1.0)]
    penalties = [None, penalties_for([1, 2, 3], [3, 4]), None, None, None, None]
    generated, banned = [0, 0, 0, 0, 2, 1], [frozenset({0})] * 6
    got = process(logits, params, penalties, generated, banned)
    assert got is not logits
    assert torch.equal(logits, before)
    for row in (0, 2, 4):  # unprocessed, or processed with nothing to do at this step
        assert torch.equal(got[row], before[row])
    assert got[3, 4] == before[3, 4] + 5.0
    assert got[5, 0] == -INF
    assert not torch.equal(got[1], before[1])
    for row in (1, 3, 5):
        assert torch.equal(got[row], one_row(before[row], params[row], penalties[row], generated[row], banned[row]))


def test_in_place_writes_the_processed_rows_of_the_callers_tensor() -> None:
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    params = [SamplingParams(logit_bias=((1, 0.5),)), PLAIN, SamplingParams(min_new_tokens=1)]
    got = process(logits, params, [None] * 3, [0, 0, 0], [frozenset({0})] * 3, in_place=True)
    assert got is logits
    assert logits.tolist() == [[1.0, 2.5], [3.0, 4.0], [-INF, 6.0]]
    untouched = torch.tensor([[1.0, 2.0]])
    assert process(untouched, [PLAIN], [None], [0], [frozenset()], in_place=True) is untouched


def test_bfloat16_rows_are_processed_in_bfloat16() -> None:
    logits = torch.tensor([1.0, -2.0, 4.0, 0.5], dtype=torch.bfloat16)
    params = SamplingParams(logit_bias=((0, 0.5),), min_new_tokens=1, repetition_penalty=2.0, frequency_penalty=0.25)
    got = one_row(logits, params, penalties_for([1], [2, 2], vocab=4), banned=frozenset({3}))
    assert got.dtype == torch.bfloat16
    assert got.tolist() == [1.5, -4.0, 4.0 / 2 - 2 * 0.25, -INF]


def test_the_batch_arguments_must_match_the_rows() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"one entry per row of logits \(2\), got 2, 1, 2, 2"):
        process(logits, [PLAIN, PLAIN], [None], [0, 0], [frozenset(), frozenset()])
    with pytest.raises(ValueError, match=r"got 1, 1, 1, 1"):
        process(logits, [PLAIN], [None], [0], [frozenset()])
    with pytest.raises(ValueError, match="row 1 is penalized"):
        process(logits, [PLAIN, SamplingParams(frequency_penalty=1.0)], [None, None], [0, 0], [frozenset()] * 2)


# --- Penalties ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 19), max_size=12),
       steps=st.lists(st.lists(st.integers(0, 19), max_size=4), max_size=8))
def test_penalties_added_step_by_step_equal_a_recount(prompt: list[int], steps: list[list[int]]) -> None:
    state = Penalties(prompt, 20, CPU)
    output: list[int] = []
    for tokens in steps:
        state.add(tokens)
        output += tokens
        assert torch.equal(state.counts, torch.bincount(torch.tensor(output, dtype=torch.long), minlength=20).float())
        assert state.seen.tolist() == [t in set(prompt) | set(output) for t in range(20)]
        assert state.seen_ids.tolist() == list(dict.fromkeys(prompt + output))  # distinct, in the order first seen
        assert state.output_ids.tolist() == list(dict.fromkeys(output))
    assert state.counts.dtype == torch.float32 and state.seen.dtype == torch.bool


def test_penalties_start_from_the_prompt() -> None:
    state = Penalties([3, 3, 0], 5, CPU)
    assert state.seen.tolist() == [True, False, False, True, False]
    assert state.counts.tolist() == [0.0] * 5
    state.add([])
    assert state.counts.tolist() == [0.0] * 5
    state.add([4, 4])
    assert state.counts.tolist() == [0.0, 0.0, 0.0, 0.0, 2.0]
    assert state.seen.tolist() == [True, False, False, True, True]
    assert state.seen_ids.tolist() == [3, 0, 4] and state.output_ids.tolist() == [4]
    empty = Penalties([], 3, CPU)
    assert empty.seen.tolist() == [False] * 3 and empty.seen_ids.tolist() == [] and empty.output_ids.tolist() == []
    logits = torch.tensor([1.0, -1.0, 2.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
    assert torch.equal(one_row(logits, params, empty), logits)


def test_penalties_take_ids_of_any_integer_type() -> None:
    # numpy's small integers make int16 or uint8 tensors (uint8 would index as a mask): read as ids
    state = Penalties(list(np.array([3, 1, 3], dtype=np.int16)), 6, CPU)
    state.add(list(np.array([5, 1, 5], dtype=np.uint8)))
    state.add(list(np.array([2], dtype=np.int16)))
    assert state.seen.tolist() == [False, True, True, True, False, True]
    assert state.counts.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 2.0]
    assert state.seen_ids.tolist() == [3, 1, 5, 2] and state.output_ids.tolist() == [5, 1, 2]
    assert state.seen_ids.dtype == state.output_ids.dtype == torch.long


def test_penalties_and_bias_are_float32_whatever_torchs_default_dtype() -> None:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        state = Penalties([1], 4, CPU)
        state.add([2, 2])
        assert state.counts.dtype == torch.float32 and state.counts.tolist() == [0.0, 0.0, 2.0, 0.0]
        logits = torch.ones(4, dtype=torch.float32)
        got = one_row(logits, SamplingParams(frequency_penalty=0.5, logit_bias=((3, 0.1),)), state)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, 1.0, 0.0, (torch.tensor(1.0) + torch.tensor(0.1)).item()]


def test_penalties_and_process_keep_every_tensor_on_the_sequences_device() -> None:
    with Accelerator():
        fresh = Penalties([], 5, META)
        assert [t.device for t in (fresh.counts, fresh.seen, fresh.seen_ids, fresh.output_ids)] == [META] * 4
        state = Penalties([0, 1, 1], 5, META)
        state.add([2, 2, 3])
        state.add([3, 4])
        tensors = (state.counts, state.seen, state.seen_ids, state.output_ids)
        assert [t.device for t in tensors] == [META] * 4
        assert [t.shape[0] for t in tensors] == [5, 5, 5, 3]
        params = SamplingParams(logit_bias=((0, 1.0), (3, -1.0)), min_new_tokens=2, repetition_penalty=1.5,
                                presence_penalty=0.5, frequency_penalty=0.25)
        out = process(torch.zeros(2, 5, device=META), [params, PLAIN], [state, None], [0, 0],
                      [frozenset({4}), frozenset()])
        assert out.device == META and out.shape == (2, 5)


def test_penalties_refuse_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, vocab_size 5\), got 5"):
        Penalties([0, 5], 5, CPU)
    state = Penalties([0], 5, CPU)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab_size 5\), got -1"):
        state.add([2, -1])
    state.add([4])
    assert state.counts.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert state.seen_ids.tolist() == [0, 4] and state.output_ids.tolist() == [4]  # nothing kept of the refused step


# --- min_p in the sampler -----------------------------------------------------------------------

def transformers_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """generate's warpers, in its order, then the softmax it draws from."""
    scores, ids = logits[None], torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.softmax(scores, -1)[0]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.05), (1.3, 40, 1.0, 0.2), (0.9, 0, 0.9, 0.3), (1.0, 30, 0.95, 0.1),
    (0.5, 0, 1.0, 1.0), (2.0, 0, 1.0, 0.5),
])
def test_min_p_is_transformers_after_temperature_top_k_and_top_p(temperature: float, top_k: int, top_p: float,
                                                                 min_p: float) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    without = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(5):
        logits = random_logits(1, seed=100 + seed, vocab=500)[0]
        got, want = warped_probs(logits, p), transformers_probs(logits, p)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert (got > 0).sum() < (warped_probs(logits, without) > 0).sum()


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_likeliest() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    got = warped_probs(probs.log(), SamplingParams(temperature=1.0, min_p=0.25))
    # 0.125 = 0.25 x 0.5 stays, as in transformers (kept unless strictly below)
    assert got.tolist() == pytest.approx([4 / 7, 2 / 7, 1 / 7, 0.0, 0.0], rel=1e-6, abs=0)
    assert warped_probs(probs.log(), SamplingParams(temperature=1.0, min_p=0.0)).tolist() == pytest.approx(
        probs.tolist(), rel=1e-6)


def test_min_p_above_one_keeps_the_likeliest() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0 - 1e-3])
    assert warped_probs(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert warped_probs(logits, SamplingParams(temperature=1.0, min_p=1.5)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_rows_ignore_min_p_and_sampled_rows_draw_inside_it() -> None:
    logits = random_logits(8, seed=9, vocab=200)
    params = [SamplingParams(min_p=0.9)] * 4 + [SamplingParams(temperature=1.0, min_p=0.5, seed=s) for s in range(4)]
    tokens = sample(logits.clone(), params, [new_generator(p, CPU) for p in params])
    assert tokens[:4] == logits[:4].argmax(-1).tolist()
    for row in range(4, 8):
        allowed = torch.softmax(logits[row], -1) >= 0.5 * torch.softmax(logits[row], -1).max()
        assert allowed[tokens[row]]


def test_the_smallest_repetition_penalty_keeps_logits_finite_and_samplable() -> None:
    """Found by the fuzz drill: 2**-149 divided a positive logit to +inf, and multinomial refused
    the row (the engine exited). Now the largest float: a seen positive token is drawn."""
    params = SamplingParams(temperature=0.365, repetition_penalty=2.0 ** -149)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    state = Penalties([0, 1, 2], 5, torch.device("cpu"))
    out = process(logits, [params], [state], [0], [frozenset()])
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == out[0, 2].item() == torch.finfo(torch.float32).max
    assert sample(out, [params], [new_generator(params, torch.device("cpu"))])[0] in (0, 2)
    masked = process(logits, [replace(params, min_new_tokens=1)], [state], [0], [frozenset({0})])
    assert masked[0, 0].item() == float("-inf")  # a masked token stays masked
