"""Prompt-lookup speculation (engine_service/generation/speculative.py): proposals against a brute-force
search, greedy verification against step-by-step argmax decoding, and sampled verification
against the exact distribution of the target's own samples (seeded, so it cannot flake)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service.generation.sampler import new_generator, sample, warped_probs
from engine_service.generation.speculative import NgramIndex, SpeculativeConfig, verify
from engine_service.requests import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams()


def brute_force_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule as NgramIndex documents it, by scanning the text backwards."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


ngram_ranges = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.lists(st.integers(0, 2), max_size=8), max_size=6),
       ngram_range=ngram_ranges, k=st.integers(1, 6))
def test_propose_matches_a_brute_force_search(chunks: list[list[int]], ngram_range: tuple[int, int], k: int) -> None:
    min_n, max_n = ngram_range
    index = NgramIndex(min_n, max_n)
    text: list[int] = []
    assert index.propose(k) == []
    for chunk in chunks:  # the prompt, then output fed in pieces (one token, or several accepted at once)
        index.extend(chunk)
        text.extend(chunk)
        assert len(index) == len(text)
        assert index.propose(k) == brute_force_proposal(text, min_n, max_n, k)


def test_propose_prefers_the_longest_then_the_latest_match() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    index.extend([7, 8, 9, 1, 5, 8, 9, 2, 3, 7, 8, 9])
    assert index.propose(2) == [1, 5]  # [7, 8, 9] matches at the start, beating the later [8, 9]
    index.extend([4, 6, 9])
    assert index.propose(3) == [4, 6, 9]  # no 3- or 2-gram repeats: the latest earlier [9] (of three)
    index.extend([6, 9])
    assert index.propose(5) == [6, 9]  # [6, 9] repeats, [9, 6, 9] does not; the text ends 2 tokens after it


def test_the_suffix_is_not_its_own_match() -> None:
    index = NgramIndex(min_n=2, max_n=2)
    index.extend([1, 2])
    assert index.propose(4) == []
    index.extend([1, 2])
    assert index.propose(4) == [1, 2]
    repeated = NgramIndex(min_n=1, max_n=4)
    repeated.extend([5, 5, 5])
    assert repeated.propose(4) == [5]  # [5, 5] at 0..1, overlapping the suffix, followed by one 5


def random_logits(seed: int, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values, so rows hold several maxima and the tie-break matters
        return torch.randint(0, 3, (rows, vocab), generator=generator).float()
    return torch.randn(rows, vocab, generator=generator)


def step_by_step_greedy(draft: list[int], logits: torch.Tensor) -> list[int]:
    """Non-speculative decoding: one `sample` call per position, going on while it agrees with the draft."""
    emitted: list[int] = []
    for i in range(len(draft) + 1):
        token = sample(logits[i:i + 1].clone(), [GREEDY], [None])[0]
        emitted.append(token)
        if i == len(draft) or token != draft[i]:
            return emitted
    raise AssertionError("unreachable")


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(0, 6), vocab=st.integers(2, 12), ties=st.booleans())
def test_greedy_verify_equals_step_by_step_argmax(seed: int, k: int, vocab: int, ties: bool) -> None:
    logits = random_logits(seed, k + 1, vocab, ties)
    right = logits.argmax(dim=-1).tolist()[:k]
    assert verify(right, logits, GREEDY, None) == step_by_step_greedy(right, logits) == logits.argmax(-1).tolist()
    for wrong_at in range(k):
        draft = list(right)
        draft[wrong_at] = (right[wrong_at] + 1) % vocab
        emitted = verify(draft, logits, GREEDY, None)
        assert emitted == step_by_step_greedy(draft, logits)
        assert emitted == right[:wrong_at + 1]
    assert verify([], logits[:1], GREEDY, None) == [int(logits[0].argmax())]


def test_greedy_ties_are_broken_like_sample() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    first = sample(logits[:1].clone(), [GREEDY], [None])[0]
    assert verify([2], logits, GREEDY, None) == [first]  # the other maximum is not "the argmax"
    assert verify([first], logits, GREEDY, None) == [first, sample(logits[1:].clone(), [GREEDY], [None])[0]]


def expected_outcomes(draft: list[int], probs: list[torch.Tensor]) -> dict[tuple[int, ...], float]:
    """The exact distribution of what verification emits: autoregressive sampling from the target
    rows, stopping at the first token that differs from the draft (or after the bonus)."""
    outcomes: dict[tuple[int, ...], float] = {}
    prefix_mass = 1.0
    for i, row in enumerate(probs):
        for token, mass in enumerate(row.tolist()):
            if i < len(draft) and token == draft[i]:
                continue
            outcomes[(*draft[:i], token)] = prefix_mass * mass
        if i < len(draft):
            prefix_mass *= float(row[draft[i]])
    return outcomes


TRIALS = 20_000
TARGET_LOGITS = torch.tensor([
    [2.0, 1.0, 0.5, 0.0, -1.0],  # row 0
    [0.0, 1.5, 0.3, 1.0, -0.5],  # row 1: after draft[0]
    [1.0, 0.0, 1.0, 0.2, 0.4],   # row 2: the bonus
])


@pytest.mark.parametrize(("params", "draft"), [
    (SamplingParams(temperature=1.0, seed=11), [0, 3]),  # a likely first token, then a less likely one
    (SamplingParams(temperature=0.7, seed=12), [1, 1]),  # a draft that is mostly wrong at row 0
    (SamplingParams(temperature=1.3, top_k=3, seed=13), [0, 4]),  # draft[1] is outside the top 3: never accepted
    (SamplingParams(temperature=1.0, top_p=0.8, seed=14), [0, 1]),
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.7, seed=15), [2, 3]),  # draft[0] outside the nucleus
])
def test_sampled_verify_preserves_the_target_distribution(params: SamplingParams, draft: list[int]) -> None:
    probs = [warped_probs(row, params) for row in TARGET_LOGITS]
    expected = expected_outcomes(draft, probs)
    generator = new_generator(params, CPU)
    counts: dict[tuple[int, ...], int] = dict.fromkeys(expected, 0)
    for _ in range(TRIALS):
        emitted = tuple(verify(draft, TARGET_LOGITS, params, generator))
        assert emitted in counts, f"{emitted} is not a possible outcome"
        counts[emitted] += 1
    for outcome, mass in expected.items():
        if mass == 0.0:
            assert counts[outcome] == 0, f"{outcome} has no mass under {params} but was emitted"
        assert abs(counts[outcome] / TRIALS - mass) < 0.02, (outcome, counts[outcome] / TRIALS, mass)


def test_top_k_and_top_p_restrict_what_is_accepted_and_resampled() -> None:
    logits = TARGET_LOGITS[:2]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=3)  # top 3: 0.63, 0.23, 0.14
    nucleus = {int(t) for t in torch.nonzero(warped_probs(logits[0], params)).flatten()}
    assert nucleus == {0, 1}
    generator = new_generator(params, CPU)
    seen = set()
    for _ in range(500):
        emitted = verify([4], logits, params, generator)  # token 4 is outside the top 3: always rejected
        assert len(emitted) == 1
        seen.add(emitted[0])
    assert seen == nucleus


def test_sampled_with_top_k_1_is_greedy() -> None:
    logits = random_logits(5, 6, 50, ties=False)
    params = SamplingParams(temperature=0.9, top_k=1, seed=2)
    right = logits.argmax(dim=-1).tolist()
    for draft in (right[:5], [right[0], (right[1] + 1) % 50, *right[2:5]], []):
        rows = logits[:len(draft) + 1]
        assert verify(draft, rows, params, new_generator(params, CPU)) == verify(draft, rows, GREEDY, None)


def test_sample_draws_from_warped_probs() -> None:
    """The refactor keeps `sample` bit-identical: its draw is multinomial over warped_probs."""
    logits = random_logits(9, 1, 64, ties=False)
    for params in (SamplingParams(temperature=0.8, seed=s, top_k=k, top_p=p)
                   for s, k, p in itertools.product(range(5), (0, 10), (1.0, 0.9))):
        expected = torch.multinomial(warped_probs(logits[0], params), 1, generator=new_generator(params, CPU))
        assert sample(logits.clone(), [params], [new_generator(params, CPU)]) == [int(expected[0])]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "eagle"}, "method must be one of ngram, got 'eagle'"),
    ({"num_tokens": 0}, "num_tokens must be an integer >= 1, got 0"),
    ({"min_n": 0}, "min_n must be an integer >= 1, got 0"),
    ({"min_n": 3, "max_n": 2}, "max_n must be an integer >= min_n 3, got 2"),
])
def test_config_validation_names_the_field_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_index_and_verify_validation_name_the_value() -> None:
    with pytest.raises(ValueError, match="min_n must be an integer >= 1, got -1"):
        NgramIndex(min_n=-1)
    with pytest.raises(ValueError, match="max_n must be an integer >= min_n 2, got 1"):
        NgramIndex(min_n=2, max_n=1)
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        NgramIndex().propose(0)
    with pytest.raises(ValueError, match=r"logits must have shape \(len\(draft\) \+ 1, V\) = \(3, V\), got \(2, 5\)"):
        verify([1, 2], TARGET_LOGITS[:2], GREEDY, None)
    assert SpeculativeConfig() == SpeculativeConfig(method="ngram", num_tokens=4, min_n=2, max_n=4)


# -- found by `make mutate` (docs/mutation-testing.md) -------------------------------------------

def test_sampled_verify_draws_from_its_generator_alone() -> None:
    """Seeded verification is reproducible: the acceptance draws, the resample after a rejection and
    the bonus all come from the request's generator, so the global RNG's state changes nothing."""
    params = SamplingParams(temperature=1.0, seed=21)
    runs = []
    with torch.random.fork_rng():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            generator = new_generator(params, CPU)
            runs.append([tuple(verify(draft, TARGET_LOGITS, params, generator))
                         for _ in range(100) for draft in ([0, 3], [1, 1], [0, 0])])
    assert runs[0] == runs[1]
    assert {len(emitted) for emitted in runs[0]} == {1, 2, 3}  # rejected at row 0, at row 1, and a bonus


def test_verify_with_an_empty_draft_is_seeded_sampling() -> None:
    """No draft: the bonus token alone, drawn as `sample` draws it with an equally seeded generator."""
    logits = random_logits(4, 1, 40, ties=False)
    with torch.random.fork_rng():
        for seed in range(20):
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
            torch.manual_seed(1000 + seed)  # the global RNG is in another state for each call
            got = verify([], logits, params, new_generator(params, CPU))
            torch.manual_seed(seed)
            assert got == sample(logits.clone(), [params], [new_generator(params, CPU)])


def test_the_acceptance_draw_is_made_on_the_logits_device() -> None:
    """Not on torch's default device, which an application embedding the engine may have changed
    (on CUDA, a draw on the CPU device with a CUDA generator fails)."""
    params = SamplingParams(temperature=1.0, seed=3)
    want = verify([0, 3], TARGET_LOGITS, params, new_generator(params, CPU))
    with torch.device("meta"):
        assert verify([0, 3], TARGET_LOGITS, params, new_generator(params, CPU)) == want


ZERO_DRAW_SEED = 5528393  # a CPU generator seeded with it draws exactly 0.0 first (mt19937's low 24 bits 0)


def test_a_draft_token_without_mass_is_refused_even_by_a_zero_draw() -> None:
    """Accept when the uniform draw is below p(x): a token outside the top-k (p = 0) is refused even
    when the draw is exactly 0.0, which torch.rand can return."""
    params = SamplingParams(temperature=1.0, top_k=2, seed=ZERO_DRAW_SEED)
    assert float(torch.rand((), generator=new_generator(params, CPU))) == 0.0
    emitted = verify([4], TARGET_LOGITS[:2], params, new_generator(params, CPU))
    assert len(emitted) == 1 and emitted[0] in (0, 1)  # token 4 refused, replaced from the top 2


def test_one_draft_token_is_a_valid_config() -> None:
    assert SpeculativeConfig(num_tokens=1).num_tokens == 1


def test_the_index_defaults_to_two_to_four_token_ngrams() -> None:
    index = NgramIndex()
    assert (index.min_n, index.max_n) == (2, 4)
    index.extend([1, 2, 9, 1, 2])
    assert index.propose(3) == [9, 1, 2]  # a 2-gram match is enough
    index = NgramIndex()
    index.extend([5, 1, 2, 3, 4, 7, 6, 1, 2, 3, 4, 8, 5, 1, 2, 3, 4])
    assert index.propose(1) == [8]  # the latest 4-gram [1, 2, 3, 4], not the 5-gram [5, 1, 2, 3, 4] at the start
