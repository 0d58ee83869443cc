"""What top-k and top-p let the sampler draw: over many fixed seeds, no token outside the top k or
outside the nucleus, every token inside drawn, and a support that differs from unrestricted
sampling on the same logits.

The seeds are fixed, so each run draws exactly the same tokens: these tests cannot flake. They
would hold with other seeds too: the logits are built so that each allowed token has a probability
of at least 1 in 6 and unrestricted sampling draws outside the allowed set at least 1 time in 4,
so over the 400 draws (100 in the batch test) an error hides with a probability below 1e-7."""

from __future__ import annotations

import torch

from engine_service.generation.sampler import new_generator, sample
from engine_service.requests import SamplingParams

VOCAB = 64
DRAWS = 400
CPU = torch.device("cpu")
# token ids in a shuffled order, so that "the first tokens" of the vocabulary are not the answer
ORDER = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)).tolist()


def drawn(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> set[int]:
    """The tokens drawn from `logits` (V,) with seeds 0..DRAWS-1, one row per seed in one batch."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed) for seed in range(DRAWS)]
    generators = [new_generator(p, CPU) for p in params]
    return set(sample(logits.expand(DRAWS, VOCAB).clone(), params, generators))


def top_heavy_logits() -> tuple[torch.Tensor, list[int]]:
    """Five tokens a little likelier than the 59 others (together 12% of the mass), then the rest."""
    logits = torch.zeros(VOCAB)
    top5 = ORDER[:5]
    logits[top5] = 0.5
    return logits, top5


def nucleus_logits() -> tuple[torch.Tensor, list[int]]:
    """Probabilities 0.5, 0.25, 0.15, and 0.10 spread over the other 61 tokens; returns the logits
    and the tokens in decreasing probability."""
    probs = torch.full((VOCAB,), 0.10 / (VOCAB - 3))
    ranked = ORDER[:3]
    probs[ranked] = torch.tensor([0.5, 0.25, 0.15])
    return probs.log(), ranked


def test_top_k_draws_only_and_all_of_the_k_likeliest():
    logits, top5 = top_heavy_logits()
    assert drawn(logits, top_k=5) == set(top5)
    nucleus, ranked = nucleus_logits()
    assert drawn(nucleus, top_k=1) == {ranked[0]}
    assert drawn(nucleus, top_k=3) == set(ranked)


def test_top_k_changes_the_support_of_unrestricted_sampling():
    logits, top5 = top_heavy_logits()
    unrestricted = drawn(logits)
    assert unrestricted - set(top5), "unrestricted sampling draws outside the top 5 on these logits"
    assert len(unrestricted) > 40
    assert drawn(logits, top_k=VOCAB) == unrestricted  # k = the vocabulary restricts nothing


def test_top_p_draws_only_and_all_of_the_nucleus():
    logits, ranked = nucleus_logits()
    # the smallest prefix (by probability) whose mass reaches top_p
    assert drawn(logits, top_p=0.45) == set(ranked[:1])
    assert drawn(logits, top_p=0.7) == set(ranked[:2])  # 0.5 < 0.7 <= 0.75
    assert drawn(logits, top_p=0.8) == set(ranked[:3])  # 0.75 < 0.8 <= 0.9


def test_top_p_changes_the_support_of_unrestricted_sampling():
    logits, ranked = nucleus_logits()
    unrestricted = drawn(logits)
    assert unrestricted - set(ranked), "unrestricted sampling draws outside the nucleus on these logits"
    assert len(unrestricted) > 10
    assert drawn(logits, top_p=1.0) == unrestricted


def test_top_k_applies_before_top_p_on_the_renormalised_mass():
    """Hugging Face's order: after top-k = 2 the two tokens hold 2/3 and 1/3, so top-p = 0.6 keeps
    the first alone (on the original mass, 0.5 < 0.6, it would keep both)."""
    logits, ranked = nucleus_logits()
    assert drawn(logits, top_k=2, top_p=0.6) == {ranked[0]}
    assert drawn(logits, top_k=2, top_p=0.7) == set(ranked[:2])  # 2/3 < 0.7


def test_the_nucleus_is_taken_after_temperature():
    """Temperature 0.5 sharpens 0.5/0.25/0.15 into 0.75/0.19/0.07: top-p = 0.7 keeps the first
    alone. Temperature 2 flattens them into 0.17/0.12/0.10 and 0.01 for each other token: the
    nucleus of 0.7 then holds 34 tokens, not the 64 that are drawn without it."""
    logits, ranked = nucleus_logits()
    assert drawn(logits, temperature=0.5, top_p=0.7) == {ranked[0]}
    flat = drawn(logits, temperature=2.0, top_p=0.7)
    assert set(ranked) < flat and len(flat) <= 34
    assert len(drawn(logits, temperature=2.0)) > 34


def test_each_row_of_a_batch_samples_with_its_own_restriction():
    logits, top5 = top_heavy_logits()
    nucleus, ranked = nucleus_logits()
    rows = torch.stack([logits, logits, nucleus, nucleus])
    seen: list[set[int]] = [set(), set(), set(), set()]
    for seed in range(DRAWS // 4):
        params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5, seed=seed),
                  SamplingParams(temperature=1.0, top_p=0.7, seed=seed), SamplingParams(temperature=1.0, seed=seed)]
        tokens = sample(rows.clone(), params, [new_generator(p, CPU) for p in params])
        for row, token in enumerate(tokens):
            seen[row].add(token)
    assert seen[0] == {int(logits.argmax())}  # greedy: the argmax, every time
    assert seen[1] == set(top5)
    assert seen[2] == set(ranked[:2])
    assert seen[3] - set(ranked[:2])  # the unrestricted row of the same batch is not narrowed
