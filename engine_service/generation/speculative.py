"""Prompt-lookup (n-gram) speculative decoding: the pure parts, with no model in sight.

Proposal follows vLLM's `ngram` method (vllm/v1/spec_decode/ngram_proposer.py): match the
longest suffix n-gram (min_n <= n <= max_n) of prompt + output earlier in the text and propose
the tokens that followed it. It needs no draft model, so the draft is deterministic: a one-hot
draft distribution q.

Verification is the rejection-sampling rule of speculative decoding (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling") with q one-hot: accept draft token x
with probability min(1, p(x) / q(x)) = p(x); on rejection draw from norm(max(0, p - q)), which is
p with x's mass removed. The emitted tokens are distributed exactly as the target's own samples,
and greedy requests get exactly the tokens of step-by-step argmax decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_service.generation.sampler import greedy, warped_probs
from engine_service.requests import SamplingParams

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Propose up to `num_tokens` draft tokens per step by prompt lookup with n-grams of
    `min_n`..`max_n` tokens. (vLLM's fallback, when neither bound is given, is 5..5, which its
    source calls arbitrary; 2..4 also matches a two-token phrase.)"""

    method: str = "ngram"
    num_tokens: int = 4
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        _check_ngram_range(self.min_n, self.max_n)


class NgramIndex:
    """The text of one sequence (prompt, then each accepted token) and, for every n-gram of
    min_n..max_n tokens, where its latest occurrence that is followed by a token ends.

    The rule: `propose(k)`, for n from max_n down to min_n (skipping n > the text's length),
    takes the last n tokens and looks for the most recent earlier occurrence of that n-gram,
    one ending before the text does (it may overlap the suffix). The first n with one wins,
    and the up to k tokens that followed it are returned (fewer where the text ends first).
    No match for any n: an empty list.

    An occurrence is recorded only when a token is appended after it, so the suffix itself is
    never its own match. Appending a token costs O(max_n) dictionary updates (of n-gram tuples
    of up to max_n tokens); proposing costs O(max_n + k)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        _check_ngram_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._followed_end: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest followed occurrence

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self._tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._followed_end[tuple(self._tokens[end - n:])] = end  # `token` now follows this n-gram
            self._tokens.append(token)

    def propose(self, k: int) -> list[int]:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        length = len(self._tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._followed_end.get(tuple(self._tokens[length - n:]))
            if end is not None:
                return self._tokens[end:end + k]
        return []


def verify(draft: Sequence[int], logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens to emit (1 to len(draft) + 1) after checking `draft` against the target's
    `logits` (len(draft) + 1, V), float32: row i predicts the token after draft[:i] (row 0 is the
    logits at the sequence's last token; the last row is the bonus position). The accepted draft
    tokens come first, then either the target's replacement for the first rejected one or, with
    all accepted, a bonus token. Stop tokens and max_new_tokens are the caller's to apply."""
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits must have shape (len(draft) + 1, V) = ({len(draft) + 1}, V), "
                         f"got {tuple(logits.shape)}")
    if params.greedy:
        return _verify_greedy(draft, logits)
    return _verify_sampled(draft, logits, params, generator)


def _verify_greedy(draft: Sequence[int], logits: torch.Tensor) -> list[int]:
    targets = greedy(logits).tolist()  # the argmax `sample` takes, ties broken alike
    for i, token in enumerate(draft):
        if token != targets[i]:
            return targets[:i + 1]
    return targets


def _verify_sampled(draft: Sequence[int], logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> list[int]:
    emitted: list[int] = []
    for i, token in enumerate(draft):
        probs = warped_probs(logits[i], params)
        if torch.rand((), generator=generator, device=logits.device) < probs[token]:
            emitted.append(token)
            continue
        # Rejected, so p(token) < 1 and some other token has mass; multinomial renormalises.
        probs[token] = 0.0
        emitted.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
        return emitted
    bonus = torch.multinomial(warped_probs(logits[len(draft)], params), 1, generator=generator)
    return [*emitted, int(bonus[0])]


def _check_ngram_range(min_n: int, max_n: int) -> None:
    if not isinstance(min_n, int) or min_n < 1:
        raise ValueError(f"min_n must be an integer >= 1, got {min_n!r}")
    if not isinstance(max_n, int) or max_n < min_n:
        raise ValueError(f"max_n must be an integer >= min_n {min_n}, got {max_n!r}")
