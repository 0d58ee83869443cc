"""The sampler at the edges that test_sampler_support.py does not reach: a nucleus whose mass meets
top_p exactly, top_p 1.0 at a tail the cumulative sum cannot see, and a batch whose parameters do not match its rows (found by `make mutate`,
docs/mutation-testing.md)."""

from __future__ import annotations

import pytest
import torch

from engine_service.generation.sampler import new_generator, sample, warped_probs
from engine_service.requests import SamplingParams

CPU = torch.device("cpu")


def drawn(logits: torch.Tensor, top_p: float, draws: int = 200) -> set[int]:
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=seed) for seed in range(draws)]
    return set(sample(logits.expand(draws, -1).clone(), params, [new_generator(p, CPU) for p in params]))


def test_a_prefix_whose_mass_equals_top_p_is_the_whole_nucleus() -> None:
    # two equally likely tokens: each holds exactly 0.5 (exact in float32), so the first alone reaches
    # top_p 0.5 and the second is outside the nucleus, as Hugging Face's TopPLogitsWarper decides
    logits = torch.zeros(2)
    assert len(drawn(logits, top_p=0.5)) == 1
    assert drawn(logits, top_p=0.51) == {0, 1}  # 200 draws: both appear but with probability 2 ** -199


def test_parameters_and_generators_must_match_the_rows() -> None:
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="zip"):
        sample(logits, [SamplingParams(), SamplingParams()], [None])


def test_top_p_1_keeps_even_the_tail_that_a_cumulative_sum_rounds_away() -> None:
    # top_p 1.0 is no nucleus at all; a nucleus step at 1.0 would drop the second token, whose mass
    # before it, 1 - 1.8e-35, is 1.0 in float32 (speculative verification reads these probabilities)
    probs = warped_probs(torch.tensor([0.0, -80.0]), SamplingParams(temperature=1.0, top_p=1.0))
    assert float(probs[1]) == pytest.approx(torch.exp(torch.tensor(-80.0)).item(), rel=1e-5, abs=0)
    assert probs[1] > 0
